//! Host-placed moments on a GPU: each part's moments are uploaded on a copy stream while the
//! device runs the backward pass before it, updated there, and downloaded while it runs the
//! next part's.
//!
//! The parts arrive in the same order every step (the head, the blocks from last to first,
//! the embeddings), so the first step records that order and later steps prefetch part k+1's
//! moments as soon as part k's update is queued. Per part, on two streams:
//!
//! 1. the copy stream uploads the part's moments into fresh device tensors (allocated on the
//!    compute stream, so the copies wait for a mark after the allocation);
//! 2. the compute stream waits for the upload, then runs the update kernels;
//! 3. the copy stream waits for the kernels, then downloads the moments into their page-locked
//!    buffers;
//! 4. at the next part's update (or the step's end) the compute stream waits for that download
//!    before the tensors are dropped, since the pool reuses freed memory in compute-stream order.
//!
//! So the device holds at most two parts' moments, the link's time hides behind the backward
//! pass when the pass is the slower, and the host never waits.

// The copies are asynchronous DMA between page-locked buffers and device tensors whose
// lifetimes the streams' marks, not the borrow checker, guarantee.
#![allow(unsafe_code)]

use candle_core::{Tensor, Var};

use super::state::{device_state, moment_sizes, poisoned, DeviceState, ParamState};
use super::{cuda_update, tensor_bytes};
use crate::knobs::{MasterFormat, StateLayout};
use crate::ops::compact_adam::{rounding_seed, Mark, Stager};
use crate::ops::host_optim::AdamConsts;
use crate::Result;

/// One parameter's moments on the device while its part is updated.
struct Staged {
    index: usize,
    /// m, v and, with 8-bit moments, the two scale vectors.
    tensors: Vec<Tensor>,
}

impl Staged {
    /// The staged moments as the update kernel takes them, with the parameter's compensation.
    fn device_state(&self, comp: Option<Tensor>) -> DeviceState {
        let t = &self.tensors;
        DeviceState {
            m: t[0].clone(),
            v: t[1].clone(),
            scales: (t.len() == 4).then(|| (t[2].clone(), t[3].clone())),
            comp,
        }
    }
}

type Part = (Vec<Staged>, Mark);

pub(super) struct Overlap {
    stager: Stager,
    /// The host-placed parameters of each part of the first step, in order.
    order: Vec<Vec<usize>>,
    recorded: bool,
    position: usize,
    /// The next part's moments, uploading, and its position in `order`.
    prefetched: Option<(usize, Part)>,
    /// Parts whose moments are on their way down.
    draining: Vec<Part>,
}

/// The page-locked bytes of parameter `index`'s moments, and the range in them of each tensor
/// it stages (m, v and, with 8-bit moments, the two scale vectors).
fn host_bytes<'s>(
    states: &'s mut [ParamState],
    vars: &[Var],
    index: usize,
    layout: StateLayout,
) -> Result<(&'s mut [u8], Vec<std::ops::Range<usize>>)> {
    let ParamState::Host { buffer, at, .. } = &mut states[index] else {
        return Err(crate::Error::internal(
            "a parameter whose moments are not in host memory",
        ));
    };
    let sizes = moment_sizes(layout, vars[index].elem_count());
    let ranges = at.iter().zip(sizes).map(|(&a, n)| a..a + n).collect();
    let bytes = buffer.get_mut().map_err(|_| poisoned())?.bytes()?;
    Ok((bytes, ranges))
}

fn part_bytes(part: &[Staged]) -> u64 {
    part.iter()
        .flat_map(|s| s.tensors.iter())
        .map(tensor_bytes)
        .sum()
}

impl Overlap {
    pub(super) fn new(device: &candle_core::Device) -> Result<Self> {
        Ok(Self {
            stager: Stager::new(device)?,
            order: Vec::new(),
            recorded: false,
            position: 0,
            prefetched: None,
            draining: Vec::new(),
        })
    }

    pub(super) fn begin_step(&mut self) {
        if !self.order.is_empty() {
            self.recorded = true;
        }
        self.position = 0;
    }

    pub(super) fn finish_step(&mut self) -> Result<()> {
        if let Some((_, part)) = self.prefetched.take() {
            self.release(part)?;
        }
        self.release_draining()
    }

    pub(super) fn synchronize(&self) -> Result<()> {
        Ok(self.stager.synchronize()?)
    }

    /// Frees a part's device tensors once the compute stream has passed its mark.
    fn release(&self, (staged, mark): Part) -> Result<()> {
        self.stager.compute_wait(&mark)?;
        drop(staged);
        Ok(())
    }

    /// Allocates device tensors for the moments of `indices` and queues their upload.
    fn stage(
        &self,
        states: &mut [ParamState],
        vars: &[Var],
        indices: &[usize],
        layout: StateLayout,
    ) -> Result<Part> {
        let mut staged = Vec::with_capacity(indices.len());
        for &index in indices {
            let var = &vars[index];
            let s = device_state(
                StateLayout {
                    masters: MasterFormat::F32,
                    ..layout
                },
                var.elem_count(),
                var.device(),
            )?;
            let mut tensors = vec![s.m, s.v];
            if let Some((a, b)) = s.scales {
                tensors.push(a);
                tensors.push(b);
            }
            staged.push(Staged { index, tensors });
        }
        let allocated = self.stager.compute_mark()?;
        self.stager.copies_wait(&allocated)?;
        for st in &staged {
            let (bytes, ranges) = host_bytes(states, vars, st.index, layout)?;
            for (t, range) in st.tensors.iter().zip(ranges) {
                // SAFETY: the buffer is page-locked and only these copies touch it until the
                // copies are synchronised (checkpoints wait first); the tensor is fresh, and the
                // compute stream waits for the returned mark before reading it.
                unsafe { self.stager.upload(t, &bytes[range])? };
            }
        }
        Ok((staged, self.stager.copies_mark()?))
    }

    /// Updates the host-placed parameters `grads` of one part; returns the most moment bytes
    /// staged on the device at once.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn update(
        &mut self,
        states: &mut [ParamState],
        vars: &[Var],
        grads: &[(usize, Tensor)],
        maps: Option<&(Tensor, Tensor)>,
        layout: StateLayout,
        consts: &AdamConsts,
        seed: u64,
        step: u64,
    ) -> Result<u64> {
        let indices: Vec<usize> = grads.iter().map(|(i, _)| *i).collect();
        if !self.recorded {
            self.order.push(indices.clone());
        }
        let position = self.position;
        self.position += 1;
        if indices.is_empty() {
            return Ok(0);
        }
        let (staged, uploaded) = self.uploaded(position, states, vars, &indices, layout)?;
        let mut peak = part_bytes(&staged)
            + self
                .draining
                .iter()
                .map(|(p, _)| part_bytes(p))
                .sum::<u64>();
        self.stager.compute_wait(&uploaded)?;
        for (index, g) in grads {
            let st = staged
                .iter()
                .find(|s| s.index == *index)
                .ok_or_else(|| crate::Error::internal("a parameter's moments were not staged"))?;
            let ParamState::Host { comp, .. } = &states[*index] else {
                return Err(crate::Error::internal(
                    "a host-placed parameter without host state",
                ));
            };
            let var = &vars[*index];
            let g = super::kernel_gradient(g, var)?;
            let s = st.device_state(comp.clone());
            let rounding = rounding_seed(seed, step, *index);
            cuda_update(var, &g, &s, maps, layout, consts, rounding)?;
        }
        let downloaded = self.download(states, vars, &staged, layout)?;
        self.release_draining()?;
        let current = part_bytes(&staged);
        self.draining.push((staged, downloaded));
        if self.recorded {
            if let Some(part) = self.prefetch(states, vars, layout)? {
                peak = peak.max(current + part_bytes(&part.0));
                self.prefetched = Some((self.position, part));
            }
        }
        Ok(peak)
    }

    /// The part at `position` of the step, `indices`, with its moments' upload queued: the
    /// prefetched one if it is that part, else staged now (and a wrong prefetch freed).
    fn uploaded(
        &mut self,
        position: usize,
        states: &mut [ParamState],
        vars: &[Var],
        indices: &[usize],
        layout: StateLayout,
    ) -> Result<Part> {
        match self.prefetched.take() {
            Some((at, part))
                if at == position && self.order.get(at).map(Vec::as_slice) == Some(indices) =>
            {
                Ok(part)
            }
            other => {
                if let Some((_, part)) = other {
                    self.release(part)?;
                }
                self.stage(states, vars, indices, layout)
            }
        }
    }

    /// Queues the download of a part's updated moments into their page-locked buffers, after
    /// the kernels queued so far; returns the mark after it.
    fn download(
        &self,
        states: &mut [ParamState],
        vars: &[Var],
        staged: &[Staged],
        layout: StateLayout,
    ) -> Result<Mark> {
        let updated = self.stager.compute_mark()?;
        self.stager.copies_wait(&updated)?;
        for st in staged {
            let (bytes, ranges) = host_bytes(states, vars, st.index, layout)?;
            for (t, range) in st.tensors.iter().zip(ranges) {
                // SAFETY: as in `stage`; the copy stream waits for the kernels that wrote the
                // tensor, which stays allocated until the compute stream has passed the mark
                // after this download (`release`).
                unsafe { self.stager.download(t, &mut bytes[range])? };
            }
        }
        Ok(self.stager.copies_mark()?)
    }

    /// Frees the parts whose download was queued before.
    fn release_draining(&mut self) -> Result<()> {
        let draining = std::mem::take(&mut self.draining);
        for part in draining {
            self.release(part)?;
        }
        Ok(())
    }

    /// Stages the next part of the recorded order, if it has host-placed parameters.
    fn prefetch(
        &self,
        states: &mut [ParamState],
        vars: &[Var],
        layout: StateLayout,
    ) -> Result<Option<Part>> {
        let next = self
            .order
            .get(self.position)
            .filter(|n| !n.is_empty())
            .cloned();
        match next {
            Some(next) => Ok(Some(self.stage(states, vars, &next, layout)?)),
            None => Ok(None),
        }
    }
}
