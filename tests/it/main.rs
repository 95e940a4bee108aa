//! The integration tests, one binary: every file here is a module, so `cargo test` compiles and
//! links the tests once instead of once per file (each binary links the whole crate, which on a
//! two-core machine was most of an incremental `cargo test`). Run one file's tests with
//! `cargo test --test it MODULE::` (for example `cargo test --test it sim::`); the CUDA twins
//! with `cargo test --test it -- --ignored ::cuda::` (docs/GPU.md).
//!
//! Tests of different modules now run side by side in one process: a test that needs the
//! process to itself lives elsewhere (`tests/budget.rs`, whose global allocator counts every
//! allocation of the process).

#[macro_use]
mod common;

mod bad_input;
mod chain_memory;
mod checkpoint;
mod cli;
mod cluster;
mod correctness;
mod integrity;
mod kept;
mod links;
mod npy;
mod ooc;
mod pipeline;
mod progress;
mod resume;
mod signals;
mod sim;
mod verify;
