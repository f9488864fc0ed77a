//! The streamed offloaded step: the host updates each part of the model while the device is
//! still running the backward pass of the parts before it.
//!
//! Three threads share the step, connected by bounded channels:
//!
//! - the training thread runs the passes; when the backward pass settles a part (the head, a
//!   block, the embeddings: see [`GradientSink::settled`]) it hands that part's gradients on;
//! - a download thread copies them to the host. A copy is ordered on the device's stream after
//!   the kernels queued before it, so it waits for the gradients and nothing else, while the
//!   training thread goes on queuing the next part's backward pass;
//! - an update thread runs Adam on the part's masters and moments with every core, writing the
//!   new working copies in the same pass, and uploads them. An upload too is ordered after
//!   every kernel already queued, so it lands after the last read of the old weights, and
//!   before the next step's forward pass, which is queued after the step returns.
//!
//! So a step costs about the slowest of the device's passes, the copies and the host update,
//! rather than their sum. The arithmetic is the summed step's for one micro-batch (the
//! gradient converted to f32 as the sum's first term is), so the weights are bit-identical.
//!
//! At most [`PARTS_IN_FLIGHT`] parts wait in each channel: when the host is the slower side,
//! the training thread waits rather than letting the device fill with gradients.

use std::sync::mpsc;

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};

use super::OffloadAdam;
use crate::model::gradients::GradientSink;
use crate::ops::host_optim::{self, AdamConsts, HostState};
use crate::{Error, Result};

/// Parts waiting in each channel of the stream.
pub const PARTS_IN_FLIGHT: usize = 2;

/// One part of the model's gradients: `(parameter index, gradient)`.
type Part = Vec<(usize, Tensor)>;

impl OffloadAdam {
    /// One optimizer step streamed with the backward pass: `passes` runs the forward and
    /// backward passes of the step's one micro-batch into the sink it is given, and returns the
    /// loss. The caller checks that nothing needs every gradient first (see the module docs of
    /// [`super`]).
    pub fn streamed_step(
        &mut self,
        passes: &mut dyn FnMut(&mut dyn GradientSink) -> Result<f64>,
    ) -> Result<f64> {
        self.steps += 1;
        let consts = AdamConsts::new(&self.spec, self.steps);
        let (to_download, downloads) = mpsc::sync_channel::<Part>(PARTS_IN_FLIGHT);
        let (to_update, updates) = mpsc::sync_channel::<Part>(PARTS_IN_FLIGHT);
        std::thread::scope(|scope| {
            let download = scope.spawn(move || -> Result<()> {
                for part in downloads {
                    let host = part
                        .into_iter()
                        .map(|(i, g)| Ok((i, g.to_device(&Device::Cpu)?.contiguous()?)))
                        .collect::<Result<Part>>()?;
                    if to_update.send(host).is_err() {
                        // The update thread stopped; its error is the one to report.
                        break;
                    }
                }
                Ok(())
            });
            let update = scope.spawn(|| -> Result<()> {
                for part in updates {
                    self.update_part(&consts, part)?;
                }
                Ok(())
            });
            let mut sink = PartSender {
                pending: Vec::new(),
                to_download,
            };
            let passes = passes(&mut sink);
            // Closing the channel ends the threads once they have done the last part.
            drop(sink);
            let joined = |t: std::thread::ScopedJoinHandle<'_, Result<()>>, what: &str| {
                t.join()
                    .unwrap_or_else(|_| Err(Error::internal(format!("the {what} thread panicked"))))
            };
            let (downloaded, updated) = (joined(download, "download"), joined(update, "update"));
            // A thread's failure explains the passes' (their sends fail once it is gone).
            updated.and(downloaded).and(passes)
        })
    }

    /// Updates one part's masters and moments from its host gradients and uploads its new
    /// working copies.
    fn update_part(&mut self, consts: &AdamConsts, part: Part) -> Result<()> {
        for (index, grad) in part {
            let range = self.ranges[index].clone();
            let var = &self.vars[index];
            let (storage, layout) = grad.storage_and_layout();
            let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets())
            else {
                return Err(Error::internal(format!(
                    "gradient {index} did not arrive as a contiguous host tensor"
                )));
            };
            // The part's slices of the state, with gradients of whatever dtype they came in.
            macro_rules! state {
                ($grads:expr) => {
                    HostState {
                        master: &mut self.master[range.clone()],
                        first: &mut self.first[range.clone()],
                        second: &mut self.second[range.clone()],
                        grads: $grads,
                    }
                };
            }
            let t = self.threads;
            let working = match (var.dtype(), cpu) {
                (DType::F32, CpuStorage::F32(g)) => {
                    host_optim::adam_step::<f32, f32>(consts, state!(&g[start..end]), None, t);
                    Tensor::from_slice(&self.master[range.clone()], var.dims(), var.device())?
                }
                (DType::BF16, CpuStorage::BF16(g)) => {
                    let mut w = vec![half::bf16::ZERO; range.len()];
                    host_optim::adam_step(consts, state!(&g[start..end]), Some(&mut w), t);
                    Tensor::from_vec(w, var.dims(), var.device())?
                }
                (DType::F16, CpuStorage::F16(g)) => {
                    let mut w = vec![half::f16::ZERO; range.len()];
                    host_optim::adam_step(consts, state!(&g[start..end]), Some(&mut w), t);
                    Tensor::from_vec(w, var.dims(), var.device())?
                }
                (dtype, _) => {
                    return Err(Error::internal(format!(
                        "gradient {index} is {:?} for a {dtype:?} working copy",
                        grad.dtype()
                    )))
                }
            };
            var.set(&working)?;
        }
        Ok(())
    }
}

/// Collects a part's gradients and sends it to the download thread when it is settled.
struct PartSender {
    pending: Part,
    to_download: mpsc::SyncSender<Part>,
}

impl GradientSink for PartSender {
    fn gradient(&mut self, index: usize, grad: Tensor) -> Result<()> {
        self.pending.push((index, grad));
        Ok(())
    }

    fn settled(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let part = std::mem::take(&mut self.pending);
        self.to_download
            .send(part)
            .map_err(|_| Error::internal("the offload stream stopped taking gradients"))
    }
}
