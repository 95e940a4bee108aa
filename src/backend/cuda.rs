//! CUDA backend (built in the CUDA issue). Until then selecting it is a clear error.
use super::Selected;
use crate::error::{Error, Result};

pub fn select(_engine: &crate::plan::Engine) -> Result<Selected> {
    Err(Error::backend("cuda", "no CUDA support in this build yet"))
}
