//! [`Collective`]: the operations data-parallel training needs from its process group, over
//! whichever backend carries them.
//!
//! - [`rank`]: who a process is (rank, world size, where the ranks meet), handed over by the
//!   launcher through environment variables.
//! - [`tcp`]: a star of TCP connections between processes (CPU runs and tests).
//! - `nccl`: NCCL between GPUs (`nccl` feature).
//!
//! A closed enum rather than a trait object: there are exactly three backends, the training
//! step holds one by value, and `match` keeps the single-rank case free of any indirection or
//! copy, which is what every existing single-GPU run goes through.
//!
//! All sums are of f32 buffers (gradients, f32 masters) or f64 scalars (losses, flags), and
//! every rank ends with identical bits: the TCP star sums in rank order on rank 0 and sends
//! that result out; NCCL's all-reduce gives every rank the same reduced values.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};

#[cfg(feature = "nccl")]
pub mod nccl;
pub mod rank;
pub mod tcp;

use crate::{Error, Result};
pub use rank::{RankEnv, Rendezvous};
use tcp::TcpGroup;

/// One rank's membership in a data-parallel group.
pub enum Collective {
    /// Training on one device: every operation is the identity.
    Single,
    /// Ranks on the CPU (or any device, through host copies), over TCP.
    Tcp(TcpGroup),
    /// Ranks on CUDA GPUs, over NCCL.
    #[cfg(feature = "nccl")]
    Nccl(nccl::NcclGroup),
}

impl Collective {
    /// Joins the group described by `env`, on `device` (NCCL needs the rank's GPU).
    pub fn join(env: &RankEnv, device: &Device) -> Result<Self> {
        if env.world_size == 1 {
            // A group of one (a single-GPU trial run as a rank) has nobody to talk to.
            return Ok(Collective::Single);
        }
        match &env.rendezvous {
            Rendezvous::Tcp(addr) => Ok(Collective::Tcp(TcpGroup::join(
                env.rank,
                env.world_size,
                *addr,
            )?)),
            #[cfg(feature = "nccl")]
            Rendezvous::Nccl(id) => Ok(Collective::Nccl(nccl::NcclGroup::join(
                env.rank,
                env.world_size,
                id,
                device,
            )?)),
            #[cfg(not(feature = "nccl"))]
            Rendezvous::Nccl(_) => {
                let _ = device;
                Err(Error::invalid(
                    "environment",
                    crate::collective::rank::RENDEZVOUS_ENV,
                    "asks for NCCL, but this build has no NCCL support; rebuild with `--features nccl`",
                ))
            }
        }
    }

    /// This rank (0 for a single device).
    pub fn rank(&self) -> usize {
        match self {
            Collective::Single => 0,
            Collective::Tcp(g) => g.rank(),
            #[cfg(feature = "nccl")]
            Collective::Nccl(g) => g.rank(),
        }
    }

    /// Ranks in the group (1 for a single device).
    pub fn world_size(&self) -> usize {
        match self {
            Collective::Single => 1,
            Collective::Tcp(g) => g.world_size(),
            #[cfg(feature = "nccl")]
            Collective::Nccl(g) => g.world_size(),
        }
    }

    /// Whether this rank writes checkpoints, plans and output (rank 0).
    pub fn is_root(&self) -> bool {
        self.rank() == 0
    }

    /// The backend's name, for messages.
    pub fn backend(&self) -> &'static str {
        match self {
            Collective::Single => "single",
            Collective::Tcp(_) => "tcp",
            #[cfg(feature = "nccl")]
            Collective::Nccl(_) => "nccl",
        }
    }

    /// Elementwise sum over ranks of a flat f32 tensor on this rank's device.
    pub fn all_reduce_sum(&mut self, flat: Tensor) -> Result<Tensor> {
        match self {
            Collective::Single => Ok(flat),
            Collective::Tcp(g) => {
                let mut host = host_values(&flat)?;
                g.all_reduce_sum(&mut host)?;
                Ok(Tensor::from_vec(host, flat.elem_count(), flat.device())?)
            }
            #[cfg(feature = "nccl")]
            Collective::Nccl(g) => g.all_reduce_sum(flat),
        }
    }

    /// Elementwise sum over ranks of host values; `device` is where the backend can work
    /// (NCCL copies through the GPU).
    pub fn all_reduce_sum_host(&mut self, values: &mut [f32], device: &Device) -> Result<()> {
        #[cfg(not(feature = "nccl"))]
        let _ = device;
        match self {
            Collective::Single => Ok(()),
            Collective::Tcp(g) => g.all_reduce_sum(values),
            #[cfg(feature = "nccl")]
            Collective::Nccl(g) => g.all_reduce_sum_host(values, device),
        }
    }

    /// Sums small host scalars (losses, counts) over ranks.
    pub fn sum_scalars(&mut self, values: &mut [f64]) -> Result<()> {
        match self {
            Collective::Single => Ok(()),
            Collective::Tcp(g) => g.all_reduce_sum(values),
            #[cfg(feature = "nccl")]
            Collective::Nccl(g) => g.sum_scalars(values),
        }
    }

    /// Whether `flag` is set on any rank; every rank gets the same answer.
    pub fn any(&mut self, flag: bool) -> Result<bool> {
        let mut count = [f64::from(u8::from(flag))];
        self.sum_scalars(&mut count)?;
        Ok(count[0] > 0.0)
    }

    /// `tensor` as rank `root` holds it, on every rank (same shape everywhere; the contents
    /// other ranks pass are ignored). f32 only.
    pub fn broadcast(&mut self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        match self {
            Collective::Single => Ok(tensor.clone()),
            Collective::Tcp(g) => {
                let mut host = host_values(tensor)?;
                g.broadcast(&mut host, root)?;
                Ok(Tensor::from_vec(host, tensor.dims(), tensor.device())?)
            }
            #[cfg(feature = "nccl")]
            Collective::Nccl(g) => g.broadcast(tensor, root),
        }
    }
}

/// A tensor's values as a host `Vec<f32>` (checked: the collectives carry f32 only).
fn host_values(t: &Tensor) -> Result<Vec<f32>> {
    if t.dtype() != DType::F32 {
        return Err(Error::internal(format!(
            "collectives carry f32 tensors, got {:?}",
            t.dtype()
        )));
    }
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

/// Splits `count` items of the given sizes into `parts` contiguous ranges of about equal total
/// size: part `r` ends at the first item where the running total reaches `(r + 1) / parts` of
/// the whole. Deterministic, so every rank computes the same split on its own.
pub fn balanced_ranges(sizes: &[usize], parts: usize) -> Vec<Range<usize>> {
    let total: usize = sizes.iter().sum();
    let mut ranges = Vec::with_capacity(parts);
    let (mut start, mut running, mut i) = (0, 0usize, 0);
    for part in 0..parts {
        let target = total * (part + 1) / parts.max(1);
        while i < sizes.len() && (running < target || part + 1 == parts) {
            running += sizes[i];
            i += 1;
        }
        ranges.push(start..i);
        start = i;
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_ranges_cover_everything_in_order() {
        let sizes = [10, 1, 1, 10, 5, 5];
        let r = balanced_ranges(&sizes, 2);
        assert_eq!(r, vec![0..4, 4..6]);
        let r = balanced_ranges(&sizes, 4);
        assert_eq!(r.first().unwrap().start, 0);
        assert_eq!(r.last().unwrap().end, sizes.len());
        assert!(r.windows(2).all(|w| w[0].end == w[1].start));
        // More parts than items: the extra parts are empty, nothing is lost.
        let r = balanced_ranges(&[3, 3], 3);
        assert_eq!(r.iter().map(|r| r.len()).sum::<usize>(), 2);
    }

    #[test]
    fn a_single_rank_passes_everything_through() {
        let mut c = Collective::Single;
        let t = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let sum = c.all_reduce_sum(t.clone()).unwrap();
        assert_eq!(sum.to_vec1::<f32>().unwrap(), vec![1.0, 2.0]);
        assert!(c.any(true).unwrap());
        assert!(!c.any(false).unwrap());
        assert_eq!((c.rank(), c.world_size(), c.is_root()), (0, 1, true));
    }
}
