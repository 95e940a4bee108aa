//! `devices`: the CUDA GPUs this build can use, or why there are none.

use clap::Args;

use crate::error::Result;
use crate::outln;
use crate::units::fmt_bytes;

/// List the CUDA GPUs this build can use (or say why there are none).
#[derive(Args, Debug)]
#[command(after_help = "Example:\n  mgmm-stream devices")]
pub(crate) struct DevicesArgs {}

impl DevicesArgs {
    pub(super) fn execute(self) -> Result<()> {
        devices()
    }
}

fn devices() -> Result<()> {
    match crate::backend::cuda::probe() {
        Ok(devs) => {
            for d in devs {
                outln!(
                    "cuda:{}  {}  compute capability {}.{}  memory {} free of {}",
                    d.ordinal,
                    d.name,
                    d.cc.0,
                    d.cc.1,
                    fmt_bytes(d.free),
                    fmt_bytes(d.total)
                );
            }
        }
        Err(e) => outln!(
            "{}",
            crate::progress::wrap(&format!(
                "no usable GPU: {e}\nbackend = \"auto\" will use the CPU."
            ))
        ),
    }
    Ok(())
}
