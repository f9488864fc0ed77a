//! A process group over NCCL, one GPU per rank (the `nccl` feature).
//!
//! Collectives run in place on the tensor's own device buffer, on candle's stream, so a
//! gradient bucket never leaves the GPU. The tensors are fresh contiguous buffers the training
//! step made for the purpose (a concatenated bucket, a parameter copy), so changing them in
//! place is invisible to anything else.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};
use candle_core::cuda_backend::CudaDType;
use candle_core::{CpuStorage, CudaStorage, Device, InplaceOp1, Layout, Tensor};

use crate::collective::rank::NCCL_ID_BYTES;
use crate::{Error, Result};

/// Host values are summed through the GPU in chunks of this many elements (64 MiB of f32).
const HOST_CHUNK: usize = 1 << 24;

/// A new NCCL unique id, made by the launcher and handed to every rank.
pub fn new_unique_id() -> Result<[u8; NCCL_ID_BYTES]> {
    let id = Id::new().map_err(|e| Error::Collective {
        rank: 0,
        problem: format!("cannot create an NCCL id ({e:?}); is libnccl installed?"),
    })?;
    let mut bytes = [0u8; NCCL_ID_BYTES];
    for (b, c) in bytes.iter_mut().zip(id.internal()) {
        *b = *c as u8;
    }
    Ok(bytes)
}

/// One rank's NCCL communicator and the device it serves.
pub struct NcclGroup {
    comm: Comm,
    device: Device,
}

impl NcclGroup {
    /// Joins the communicator `id` as `rank` of `world_size` on `device` (this rank's GPU).
    pub fn join(
        rank: usize,
        world_size: usize,
        id: &[u8; NCCL_ID_BYTES],
        device: &Device,
    ) -> Result<Self> {
        let Device::Cuda(cuda) = device else {
            return Err(Error::invalid(
                "device",
                "--device",
                "NCCL data parallelism needs CUDA ranks; use --device cuda (or cpu ranks over TCP)",
            ));
        };
        let mut internal = [0 as std::ffi::c_char; NCCL_ID_BYTES];
        for (c, b) in internal.iter_mut().zip(id) {
            *c = *b as std::ffi::c_char;
        }
        let comm = Comm::from_rank(cuda.cuda_stream(), rank, world_size, Id::uninit(internal))
            .map_err(|e| Error::Collective {
                rank,
                problem: format!("cannot join the NCCL communicator ({e:?})"),
            })?;
        Ok(Self {
            comm,
            device: device.clone(),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the communicator.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Sums a flat f32 tensor over ranks, in place on the device.
    pub fn all_reduce_sum(&self, flat: Tensor) -> Result<Tensor> {
        let flat = flat.contiguous()?;
        flat.inplace_op1(&InPlace {
            comm: &self.comm,
            op: Collective::Sum,
        })?;
        Ok(flat)
    }

    /// `tensor` as `root` holds it, on every rank.
    pub fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        // A copy: the caller's tensor (a parameter, a moment) must not change under it.
        let buffer = tensor.contiguous()?.copy()?;
        buffer.inplace_op1(&InPlace {
            comm: &self.comm,
            op: Collective::Broadcast(root),
        })?;
        Ok(buffer)
    }

    /// Sums host values over ranks through the GPU, a chunk at a time.
    pub fn all_reduce_sum_host(&self, values: &mut [f32], device: &Device) -> Result<()> {
        let device = if device.is_cuda() {
            device
        } else {
            &self.device
        };
        for chunk in values.chunks_mut(HOST_CHUNK) {
            let t = Tensor::from_slice(chunk, chunk.len(), device)?;
            let t = self.all_reduce_sum(t)?;
            chunk.copy_from_slice(&t.to_vec1::<f32>()?);
        }
        Ok(())
    }

    /// Sums small f64 values over ranks.
    pub fn sum_scalars(&self, values: &mut [f64]) -> Result<()> {
        let t = Tensor::from_slice(values, values.len(), &self.device)?;
        t.inplace_op1(&InPlace {
            comm: &self.comm,
            op: Collective::Sum,
        })?;
        values.copy_from_slice(&t.to_vec1::<f64>()?);
        Ok(())
    }
}

/// Which in-place collective [`InPlace`] runs.
#[derive(Clone, Copy)]
enum Collective {
    Sum,
    Broadcast(usize),
}

/// An NCCL collective as a candle in-place op, which is how candle hands out the device buffer
/// behind a tensor.
struct InPlace<'a> {
    comm: &'a Comm,
    op: Collective,
}

impl InPlace<'_> {
    fn run<T: CudaDType + NcclType>(
        &self,
        storage: &mut CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("NCCL collectives need a contiguous tensor");
        };
        let slice = storage.as_cuda_slice_mut::<T>()?;
        let mut view = slice.slice_mut(start..end);
        let status = match self.op {
            Collective::Sum => self.comm.all_reduce_in_place(&mut view, &ReduceOp::Sum),
            Collective::Broadcast(root) => self.comm.broadcast_in_place(&mut view, root as i32),
        };
        status
            .map(|_| ())
            .map_err(|e| candle_core::Error::Msg(format!("NCCL collective failed: {e:?}")))
    }
}

impl InplaceOp1 for InPlace<'_> {
    fn name(&self) -> &'static str {
        "nccl-collective"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("NCCL collectives run on CUDA tensors only")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        match storage.dtype() {
            candle_core::DType::F32 => self.run::<f32>(storage, layout),
            candle_core::DType::F64 => self.run::<f64>(storage, layout),
            other => candle_core::bail!("NCCL collectives here carry f32 or f64, got {other:?}"),
        }
    }
}
