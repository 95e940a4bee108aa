//! The check stage: [`CheckJob`]s from staging → progress published in [`CheckProgress`] (which
//! writeback waits on). Only for lanes that upload straight from the files' pages; one thread
//! per such lane. It blocks on its input channel and on the device's own check of a block when
//! the lane checks on the device.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Receiver;

use super::inputs::Inputs;
use super::messages::CheckJob;
use crate::dtype::DType;
use crate::error::Result;
use crate::metrics::StageMetrics;
use crate::pipeline::control::Control;
use crate::pipeline::direct::CheckProgress;

/// Checks the blocks a lane uploads straight from the files' pages
/// ([`crate::pipeline::direct`]): the checksums of storage tiles not verified yet and the NaN/Inf
/// count, reading the pages while the device copies them, in the order staging issued them; each
/// one passed is published in `progress`, which writeback waits on. A corrupt tile fails the run
/// here.
pub(crate) struct Checker<'a> {
    pub(crate) inputs: &'a Inputs,
    pub(crate) host_dt: DType,
    pub(crate) rx: Receiver<CheckJob>,
    pub(crate) progress: Arc<CheckProgress>,
    pub(crate) m: Arc<StageMetrics>,
}

impl Checker<'_> {
    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        // However the stage ends (done, an error, a panic), writeback must not wait forever
        // for checks that will never pass.
        struct Close<'p>(&'p CheckProgress);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                self.0.close();
            }
        }
        let _close = Close(&self.progress);
        // An error is reported before the progress closes, so that writeback, woken by the
        // close, finds the run cancelled with this error rather than a stopped stage.
        if let Err(e) = self.check_all(ctl) {
            ctl.fail(e);
        }
        Ok(())
    }

    fn check_all(&self, ctl: &Control) -> Result<()> {
        while let Some(job) = ctl.recv_timed(&self.rx, &self.m) {
            let f = self.inputs.file(job.src);
            let device = match &job.device {
                Some(rx) => self.device_results(ctl, rx)?,
                None => None,
            };
            let t = Instant::now();
            let nonfinite = match device {
                Some(r) => {
                    let n =
                        f.settle_device_check(&job.block, self.host_dt, self.inputs.verify, &r)?;
                    let bytes = (job.block.elems() * f.dtype().size()) as u64;
                    self.inputs
                        .device_checked
                        .fetch_add(bytes, Ordering::Relaxed);
                    n
                }
                None => f.scan_mapped(&job.block, self.host_dt, self.inputs.verify)?,
            };
            self.inputs.nonfinite(job.src).add(&job.block, nonfinite);
            self.progress.set(job.seq + 1);
            self.m.add_busy(t.elapsed());
            self.m
                .add_item((job.block.elems() * f.dtype().size()) as u64);
        }
        Ok(())
    }
}

impl Checker<'_> {
    /// The device's results for a block, waited for (as time waiting for input); `None`
    /// when the device could not check it (the lane dropped the sender: no kernel, a failed
    /// launch, the lane gone), so that the host checks it.
    fn device_results(
        &self,
        ctl: &Control,
        rx: &crossbeam_channel::Receiver<Box<dyn crate::backend::check::DeviceCheck>>,
    ) -> Result<Option<Vec<[u32; 2]>>> {
        let t = Instant::now();
        let got = loop {
            match rx.recv_timeout(std::time::Duration::from_millis(20)) {
                Ok(c) => break Some(c),
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break None,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) if ctl.is_cancelled() => {
                    return Err(crate::error::Error::Cancelled)
                }
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            }
        };
        let r = got.and_then(|c| c.wait().ok());
        self.m.add_wait_in(t.elapsed());
        Ok(r)
    }
}
