//! The streamed offloaded step: the host updates each part of the model while the device is
//! still running the backward pass of the parts before it.
//!
//! Two threads share the step:
//!
//! - the training thread runs the passes and makes every device call. When the backward pass
//!   settles a part (the head, a block, the embeddings: see [`GradientSink::settled`]) it
//!   queues that part's gradients for download into a free host buffer
//!   ([`crate::ops::transfer`]) and goes on queuing the next part's backward pass. Whenever it
//!   settles a part, and at the end of the step, it also queues the uploads of the parts the
//!   host has finished, and frees their device gradients;
//! - an update thread waits for each part's download, runs Adam on the part's masters and
//!   moments with every core, writing the new working copies into an upload buffer in the same
//!   pass, and hands both buffers back.
//!
//! Every copy is queued on the device's one stream, so a download runs after the kernels that
//! wrote its gradients, an upload after the last kernel that read the old weights (the part was
//! settled before its upload is queued), and the next step's forward pass after every upload.
//! The host waits on a buffer's own copy and nothing else. Keeping the device calls on one
//! thread leaves no question of which thread holds the device's context or frees its memory.
//!
//! So a step costs about the slowest of the device's passes, the copies and the host update,
//! rather than their sum. The arithmetic is the summed step's for one micro-batch (the gradient
//! converted to f32 as the sum's first term is), so the weights are bit-identical.
//!
//! The host buffers are kept from step to step: [`DOWNLOAD_BUFFERS`] for gradients and
//! [`UPLOAD_BUFFERS`] for working copies, each as large as the largest part. When the host is
//! the slower side the training thread waits for a free download buffer, so at most
//! [`PARTS_IN_FLIGHT`] parts' gradients wait on the device.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var};

use super::OffloadAdam;
use crate::model::gradients::GradientSink;
use crate::ops::host_optim::{self, AdamConsts, HostState};
use crate::ops::transfer::{self, HostBuffer, Link};
use crate::{Error, Result};

/// Parts whose gradients may wait for the host while the device goes on.
pub const PARTS_IN_FLIGHT: usize = 2;

/// Gradient buffers: the parts in flight and the one the host is updating.
pub const DOWNLOAD_BUFFERS: usize = PARTS_IN_FLIGHT + 1;

/// Working-copy buffers: one filling while the other uploads.
pub const UPLOAD_BUFFERS: usize = 2;

/// The streamed step's link and host buffers, kept from step to step.
pub(super) struct Transfers {
    link: Link,
    downloads: Vec<HostBuffer>,
    uploads: Vec<HostBuffer>,
}

impl Transfers {
    fn new(device: &Device) -> Result<Self> {
        let link = Link::new(device)?;
        let buffers = |n: usize| (0..n).map(|_| HostBuffer::new(&link)).collect();
        Ok(Self {
            downloads: buffers(DOWNLOAD_BUFFERS),
            uploads: buffers(UPLOAD_BUFFERS),
            link,
        })
    }
}

/// One parameter's place in a part's buffers.
struct Slot {
    index: usize,
    at: usize,
    bytes: usize,
}

/// A part whose download is queued, on its way to the update thread.
struct Downloaded {
    buffer: HostBuffer,
    slots: Vec<Slot>,
}

/// A part the host has updated: its download buffer, free again, and its new working copies.
struct Updated {
    download: HostBuffer,
    upload: HostBuffer,
    slots: Vec<Slot>,
}

/// Where a streamed step's host time went, for the `autotune::offload` trace.
#[derive(Default)]
struct UpdateTimes {
    /// Waiting for downloads (the device was behind).
    waited_for_download: Duration,
    /// Waiting for a free upload buffer and its previous copy.
    waited_for_upload: Duration,
    /// The Adam passes.
    adam: Duration,
}

impl UpdateTimes {
    /// Traces where step `step`'s host time went, with the training thread's wait for a free
    /// download buffer.
    fn trace(&self, step: u64, waited_for_buffer: Duration) {
        tracing::debug!(
            target: "autotune::offload",
            step,
            waited_for_buffer_s = waited_for_buffer.as_secs_f64(),
            waited_for_download_s = self.waited_for_download.as_secs_f64(),
            waited_for_upload_s = self.waited_for_upload.as_secs_f64(),
            adam_s = self.adam.as_secs_f64(),
            "streamed step"
        );
    }
}

/// What the update thread reads and writes: the optimizer's host state.
struct HostSide<'a> {
    consts: AdamConsts,
    ranges: &'a [Range<usize>],
    dtypes: Vec<DType>,
    master: &'a mut [f32],
    first: &'a mut [f32],
    second: &'a mut [f32],
    threads: usize,
}

impl OffloadAdam {
    /// One optimizer step streamed with the backward pass: `passes` runs the forward and
    /// backward passes of the step's one micro-batch into the sink it is given, and returns the
    /// loss. The caller checks that nothing needs every gradient first (see the module docs of
    /// [`super`]).
    pub fn streamed_step(
        &mut self,
        passes: &mut dyn FnMut(&mut dyn GradientSink) -> Result<f64>,
    ) -> Result<f64> {
        let consts = self.progress.begin_step();
        let mut transfers = self.take_transfers()?;
        let host = HostSide {
            consts,
            ranges: &self.ranges,
            dtypes: self.vars.iter().map(|v| v.dtype()).collect(),
            master: &mut self.master,
            first: &mut self.first,
            second: &mut self.second,
            threads: self.threads,
        };
        let (to_update, downloaded) = mpsc::channel::<Downloaded>();
        let (to_train, updated) = mpsc::channel::<Updated>();
        let (free_upload, free_uploads) = mpsc::channel::<HostBuffer>();
        for buffer in transfers.uploads.drain(..) {
            // The receiver is alive: it is `free_uploads`, two lines up.
            let _ = free_upload.send(buffer);
        }
        let link = &transfers.link;
        let mut sink = PartSender {
            pending: Vec::new(),
            in_flight: VecDeque::new(),
            free_downloads: std::mem::take(&mut transfers.downloads),
            link,
            vars: &self.vars,
            to_update: Some(to_update),
            updated,
            free_upload,
            spare_uploads: Vec::new(),
            waited: Duration::ZERO,
        };
        let (result, times) = std::thread::scope(|scope| {
            let update =
                scope.spawn(move || update_parts(host, link, downloaded, free_uploads, to_train));
            let passes = passes(&mut sink);
            // Closing the channel ends the update thread once it has done the last part; the
            // parts it finishes meanwhile are uploaded as they come.
            let finished = sink.finish();
            let joined = update
                .join()
                .unwrap_or_else(|_| Err(Error::internal("the update thread panicked")));
            match joined {
                // The update thread's failure explains the passes' (their sends fail once it is
                // gone).
                Ok((times, free_uploads)) => {
                    sink.spare_uploads.extend(free_uploads.try_iter());
                    (passes.and_then(|loss| finished.map(|()| loss)), times)
                }
                Err(e) => (Err(e), UpdateTimes::default()),
            }
        });
        let waited_for_buffer = sink.waited;
        transfers.downloads = std::mem::take(&mut sink.free_downloads);
        transfers.uploads = std::mem::take(&mut sink.spare_uploads);
        drop(sink);
        let whole = transfers.downloads.len() == DOWNLOAD_BUFFERS
            && transfers.uploads.len() == UPLOAD_BUFFERS;
        if result.is_ok() && whole {
            self.transfers = Some(transfers);
        }
        times.trace(self.progress.steps(), waited_for_buffer);
        result
    }

    /// The link and host buffers of the last step, or new ones for the first.
    fn take_transfers(&mut self) -> Result<Transfers> {
        match self.transfers.take() {
            Some(t) => Ok(t),
            None => match self.vars.first() {
                Some(v) => Transfers::new(v.device()),
                None => Err(Error::internal("an offloaded optimizer without parameters")),
            },
        }
    }
}

/// The update thread: updates each downloaded part into a free upload buffer and hands both
/// back, until the training thread stops sending. Returns its times and the upload buffers'
/// channel, which the last ones come back on.
fn update_parts(
    mut host: HostSide<'_>,
    link: &Link,
    downloaded: mpsc::Receiver<Downloaded>,
    free_uploads: mpsc::Receiver<HostBuffer>,
    to_train: mpsc::Sender<Updated>,
) -> Result<(UpdateTimes, mpsc::Receiver<HostBuffer>)> {
    // Waiting on a copy's event and page-locking memory need the device's context here too.
    link.bind_to_thread()?;
    let mut times = UpdateTimes::default();
    for part in downloaded {
        let started = Instant::now();
        let upload = free_uploads
            .recv()
            .map_err(|_| Error::internal("the training thread stopped returning buffers"))?;
        times.waited_for_upload += started.elapsed();
        let updated = host.update_part(part, upload, &mut times)?;
        if to_train.send(updated).is_err() {
            break;
        }
    }
    Ok((times, free_uploads))
}

impl HostSide<'_> {
    /// Updates one part's masters and moments from its downloaded gradients and writes its new
    /// working copies into `upload`.
    fn update_part(
        &mut self,
        part: Downloaded,
        mut upload: HostBuffer,
        times: &mut UpdateTimes,
    ) -> Result<Updated> {
        let Downloaded { mut buffer, slots } = part;
        let started = Instant::now();
        let grads_in = buffer.bytes()?;
        times.waited_for_download += started.elapsed();
        let total = slots.iter().map(|s| s.at + s.bytes).max().unwrap_or(0);
        let started = Instant::now();
        upload.reserve(total)?;
        let working = upload.bytes()?;
        times.waited_for_upload += started.elapsed();
        let started = Instant::now();
        for slot in &slots {
            let range = self.ranges[slot.index].clone();
            let dtype = self.dtypes[slot.index];
            if slot.bytes != range.len() * dtype.size_in_bytes() {
                return Err(Error::internal(format!(
                    "gradient {} has {} bytes for {} {dtype:?} values",
                    slot.index,
                    slot.bytes,
                    range.len()
                )));
            }
            let g = &grads_in[slot.at..slot.at + slot.bytes];
            let w = &mut working[slot.at..slot.at + slot.bytes];
            // The update for gradients and working copies of one element type.
            macro_rules! update {
                ($t:ty) => {
                    host_optim::adam_step(
                        &self.consts,
                        HostState {
                            master: &mut self.master[range.clone()],
                            first: &mut self.first[range.clone()],
                            second: &mut self.second[range.clone()],
                            grads: transfer::typed::<$t>(g)?,
                        },
                        Some(transfer::typed_mut::<$t>(w)?),
                        self.threads,
                    )
                };
            }
            match dtype {
                DType::F32 => update!(f32),
                DType::BF16 => update!(half::bf16),
                DType::F16 => update!(half::f16),
                dtype => {
                    return Err(Error::internal(format!(
                        "no streamed update for a {dtype:?} working copy"
                    )))
                }
            }
        }
        times.adam += started.elapsed();
        Ok(Updated {
            download: buffer,
            upload,
            slots,
        })
    }
}

/// The training thread's side: collects a part's gradients and, when it is settled, queues
/// their download and hands the part to the update thread; uploads the parts that come back.
struct PartSender<'a> {
    pending: Vec<(usize, Tensor)>,
    /// The device gradients of the parts sent, oldest first, kept until their download is done.
    in_flight: VecDeque<Vec<Tensor>>,
    free_downloads: Vec<HostBuffer>,
    link: &'a Link,
    vars: &'a [Var],
    /// `None` once the step's passes are done.
    to_update: Option<mpsc::Sender<Downloaded>>,
    updated: mpsc::Receiver<Updated>,
    free_upload: mpsc::Sender<HostBuffer>,
    /// Upload buffers that came back after the update thread stopped taking them.
    spare_uploads: Vec<HostBuffer>,
    /// Time spent waiting for a free download buffer (the host was behind).
    waited: Duration,
}

fn stopped() -> Error {
    Error::internal("the offload stream stopped taking gradients")
}

impl PartSender<'_> {
    /// Queues the upload of a part the host has finished, frees its device gradients (the
    /// update thread read their download) and takes its buffers back.
    fn upload(&mut self, part: Updated) -> Result<()> {
        let Updated {
            download,
            mut upload,
            slots,
        } = part;
        let targets: Vec<(usize, &Tensor)> = slots
            .iter()
            .map(|s| (s.at, self.vars[s.index].as_tensor()))
            .collect();
        upload.upload(self.link, &targets)?;
        // Parts come back in the order they were sent.
        self.in_flight.pop_front();
        self.free_downloads.push(download);
        if let Err(mpsc::SendError(buffer)) = self.free_upload.send(upload) {
            self.spare_uploads.push(buffer);
        }
        Ok(())
    }

    /// Uploads what the host has finished, without waiting.
    fn upload_finished(&mut self) -> Result<()> {
        while let Ok(part) = self.updated.try_recv() {
            self.upload(part)?;
        }
        Ok(())
    }

    /// Ends the step: no more parts; uploads the rest as the host finishes them.
    fn finish(&mut self) -> Result<()> {
        self.to_update = None;
        let mut result = Ok(());
        // Ends when the update thread has stopped (and dropped its sender).
        while let Ok(part) = self.updated.recv() {
            if result.is_ok() {
                result = self.upload(part);
            }
        }
        result
    }
}

impl GradientSink for PartSender<'_> {
    fn gradient(&mut self, index: usize, grad: Tensor) -> Result<()> {
        if !transfer::supported(grad.dtype()) {
            return Err(Error::internal(format!(
                "gradient {index} is {:?}",
                grad.dtype()
            )));
        }
        self.pending.push((index, grad.contiguous()?));
        Ok(())
    }

    fn settled(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        self.upload_finished()?;
        let part = std::mem::take(&mut self.pending);
        let started = Instant::now();
        let mut buffer = loop {
            if let Some(buffer) = self.free_downloads.pop() {
                break buffer;
            }
            let done = self.updated.recv().map_err(|_| stopped())?;
            self.upload(done)?;
        };
        self.waited += started.elapsed();
        let sizes: Vec<usize> = part
            .iter()
            .map(|(_, g)| g.elem_count() * g.dtype().size_in_bytes())
            .collect();
        let (offsets, total) = transfer::layout(sizes.iter().copied());
        buffer.reserve(total)?;
        let items: Vec<(usize, &Tensor)> = offsets
            .iter()
            .copied()
            .zip(part.iter().map(|(_, g)| g))
            .collect();
        buffer.download(self.link, &items)?;
        let slots = part
            .iter()
            .zip(offsets.iter().zip(&sizes))
            .map(|((index, _), (&at, &bytes))| Slot {
                index: *index,
                at,
                bytes,
            })
            .collect();
        self.in_flight
            .push_back(part.into_iter().map(|(_, g)| g).collect());
        let to_update = self.to_update.as_ref().ok_or_else(stopped)?;
        to_update
            .send(Downloaded { buffer, slots })
            .map_err(|_| stopped())
    }
}
