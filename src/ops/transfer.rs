//! Copies between device tensors and reusable host buffers: how the offloaded optimizer moves
//! gradients down and working copies up without allocating anything per step.
//!
//! On a CUDA device a [`HostBuffer`] is page-locked memory, so a copy is a DMA transfer queued
//! without blocking the host, on the device's one stream: a download runs after the kernels
//! queued before it (the gradients are written), an upload after them too (the old weights are
//! read), and the kernels queued later see the new weights. The host waits on a buffer's last
//! copy before touching it, and for nothing else. Pageable memory would make every copy block
//! the host and, through cudarc, synchronise the whole stream.
//!
//! On the CPU the buffer is heap memory and the copies are plain `memcpy`s, so the same code
//! runs in tests.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Storage, Tensor};

use crate::{Error, Result};

#[cfg(feature = "cuda")]
mod gpu;

/// Where a buffer's tensors start: a multiple of every element size and of the cache line.
pub const ALIGN: usize = 64;

/// The copy path between host memory and one device.
pub struct Link {
    #[cfg(feature = "cuda")]
    cuda: Option<gpu::Streams>,
}

impl Link {
    /// The link to `device`.
    pub fn new(device: &Device) -> Result<Self> {
        match device {
            Device::Cpu => Ok(Self {
                #[cfg(feature = "cuda")]
                cuda: None,
            }),
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => Ok(Self {
                cuda: Some(gpu::Streams::new(dev)?),
            }),
            #[allow(unreachable_patterns)]
            other => Err(Error::internal(format!(
                "host transfers are not supported on {other:?}"
            ))),
        }
    }

    /// Makes the device's context current on the calling thread, which waits on copies or
    /// allocates buffers from a thread other than the one that opened the device.
    pub fn bind_to_thread(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(streams) = &self.cuda {
            return streams.bind_to_thread();
        }
        Ok(())
    }
}

/// A reusable host buffer that tensors are downloaded into and uploaded from, at offsets
/// rounded up to [`ALIGN`].
pub struct HostBuffer {
    memory: Memory,
}

enum Memory {
    /// u64 words, so that every offset that is a multiple of [`ALIGN`] is aligned for f32.
    Heap(Vec<u64>),
    #[cfg(feature = "cuda")]
    Pinned(gpu::Pinned),
}

/// Offsets for `sizes` bytes laid out one after another at [`ALIGN`], and the total.
pub fn layout(sizes: impl IntoIterator<Item = usize>) -> (Vec<usize>, usize) {
    let mut end = 0;
    let offsets = sizes
        .into_iter()
        .map(|n| {
            let at = end;
            end += n.div_ceil(ALIGN) * ALIGN;
            at
        })
        .collect();
    (offsets, end)
}

impl HostBuffer {
    /// An empty buffer of the kind `link` copies through; [`Self::reserve`] sizes it.
    pub fn new(link: &Link) -> Self {
        #[cfg(feature = "cuda")]
        if let Some(streams) = &link.cuda {
            return Self {
                memory: Memory::Pinned(gpu::Pinned::empty(streams)),
            };
        }
        let _ = link;
        Self {
            memory: Memory::Heap(Vec::new()),
        }
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> usize {
        match &self.memory {
            Memory::Heap(words) => words.len() * 8,
            #[cfg(feature = "cuda")]
            Memory::Pinned(p) => p.len(),
        }
    }

    /// Grows the buffer to at least `bytes` (its contents are not kept), after its copies.
    pub fn reserve(&mut self, bytes: usize) -> Result<()> {
        if bytes <= self.capacity() {
            return Ok(());
        }
        match &mut self.memory {
            Memory::Heap(words) => *words = vec![0; bytes.div_ceil(8)],
            #[cfg(feature = "cuda")]
            Memory::Pinned(p) => p.reallocate(bytes)?,
        }
        Ok(())
    }

    /// The bytes, once every copy queued on the buffer has finished.
    pub fn bytes(&mut self) -> Result<&mut [u8]> {
        match &mut self.memory {
            Memory::Heap(words) => Ok(bytemuck::cast_slice_mut(words.as_mut_slice())),
            #[cfg(feature = "cuda")]
            Memory::Pinned(p) => p.bytes(),
        }
    }

    /// Queues copies of the contiguous `tensors` into the buffer at their offsets (see
    /// [`layout`]), after the work already queued that writes them. The tensors must live
    /// until [`Self::bytes`] returns.
    pub fn download(&mut self, link: &Link, tensors: &[(usize, &Tensor)]) -> Result<()> {
        check_fits(self.capacity(), tensors)?;
        match &mut self.memory {
            Memory::Heap(words) => {
                let _ = link;
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(words.as_mut_slice());
                for &(at, t) in tensors {
                    let (storage, layout) = t.storage_and_layout();
                    let Storage::Cpu(cpu) = &*storage else {
                        return Err(Error::internal("a device tensor on a host link"));
                    };
                    let src = cpu_bytes(cpu, layout)?;
                    bytes[at..at + src.len()].copy_from_slice(src);
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Memory::Pinned(p) => p.download(link.streams()?, tensors),
        }
    }

    /// Queues copies from the buffer at their offsets into the contiguous `targets` in place,
    /// after the work already queued that reads them; work queued later sees the new values.
    pub fn upload(&mut self, link: &Link, targets: &[(usize, &Tensor)]) -> Result<()> {
        check_fits(self.capacity(), targets)?;
        match &mut self.memory {
            Memory::Heap(words) => {
                let _ = link;
                let bytes: &[u8] = bytemuck::cast_slice(words.as_slice());
                for &(at, t) in targets {
                    let n = t.elem_count() * t.dtype().size_in_bytes();
                    t.inplace_op1(&Upload {
                        bytes: &bytes[at..at + n],
                    })?;
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Memory::Pinned(p) => p.upload(link.streams()?, targets),
        }
    }
}

#[cfg(feature = "cuda")]
impl Link {
    fn streams(&self) -> Result<&gpu::Streams> {
        self.cuda
            .as_ref()
            .ok_or_else(|| Error::internal("a pinned buffer on a host link"))
    }
}

fn check_fits(capacity: usize, tensors: &[(usize, &Tensor)]) -> Result<()> {
    for &(at, t) in tensors {
        let n = t.elem_count() * t.dtype().size_in_bytes();
        if at % ALIGN != 0 || at + n > capacity {
            return Err(Error::internal(format!(
                "a {n}-byte tensor at offset {at} of a {capacity}-byte host buffer"
            )));
        }
    }
    Ok(())
}

/// The bytes of a contiguous float CPU tensor.
fn cpu_bytes<'a>(cpu: &'a CpuStorage, layout: &Layout) -> Result<&'a [u8]> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(Error::internal("a strided tensor in a host transfer"));
    };
    Ok(match cpu {
        CpuStorage::F32(v) => bytemuck::cast_slice(&v[start..end]),
        CpuStorage::BF16(v) => bytemuck::cast_slice(&v[start..end]),
        CpuStorage::F16(v) => bytemuck::cast_slice(&v[start..end]),
        CpuStorage::U8(v) => &v[start..end],
        other => {
            return Err(Error::internal(format!(
                "a {:?} tensor in a host transfer",
                other.dtype()
            )))
        }
    })
}

/// The elements of `dtype` at `bytes`, which [`layout`] aligned.
pub fn typed<T: bytemuck::Pod>(bytes: &[u8]) -> Result<&[T]> {
    bytemuck::try_cast_slice(bytes).map_err(|e| Error::internal(format!("host buffer view: {e}")))
}

/// [`typed`], mutably.
pub fn typed_mut<T: bytemuck::Pod>(bytes: &mut [u8]) -> Result<&mut [T]> {
    bytemuck::try_cast_slice_mut(bytes)
        .map_err(|e| Error::internal(format!("host buffer view: {e}")))
}

/// Overwrites a tensor's storage with host bytes of its dtype.
struct Upload<'a> {
    bytes: &'a [u8],
}

impl InplaceOp1 for Upload<'_> {
    fn name(&self) -> &'static str {
        "host-upload"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("host-upload: the target must be contiguous");
        };
        fn copy<T: bytemuck::Pod>(dst: &mut [T], src: &[u8]) -> candle_core::Result<()> {
            let src: &[T] = bytemuck::try_cast_slice(src)
                .map_err(|e| candle_core::Error::Msg(format!("host-upload: {e}")))?;
            if src.len() != dst.len() {
                candle_core::bail!("host-upload: {} values for {}", src.len(), dst.len());
            }
            dst.copy_from_slice(src);
            Ok(())
        }
        match storage {
            CpuStorage::F32(v) => copy(&mut v[start..end], self.bytes),
            CpuStorage::BF16(v) => copy(&mut v[start..end], self.bytes),
            CpuStorage::F16(v) => copy(&mut v[start..end], self.bytes),
            CpuStorage::U8(v) => copy(&mut v[start..end], self.bytes),
            other => candle_core::bail!("host-upload: a {:?} target", other.dtype()),
        }
    }
}

/// Bytes each direction of [`measure_gbps`] copies: large enough that the copy's fixed cost
/// disappears in it, small enough to take a few milliseconds of a trial's setup.
const MEASURE_BYTES: usize = 256 << 20;

/// The speed of `device`'s host link as the offloaded step uses it (page-locked buffers, a
/// download and an upload), GB/s (10^9 bytes) over both directions, the fastest of three
/// round trips; `None` on the CPU, which has no link.
pub fn measure_gbps(device: &Device) -> Result<Option<f64>> {
    if device.is_cpu() {
        return Ok(None);
    }
    let link = Link::new(device)?;
    let mut buffer = HostBuffer::new(&link);
    buffer.reserve(MEASURE_BYTES)?;
    let tensor = Tensor::zeros(MEASURE_BYTES / 4, DType::F32, device)?;
    device.synchronize()?;
    let mut fastest = f64::INFINITY;
    for _ in 0..3 {
        let started = std::time::Instant::now();
        buffer.download(&link, &[(0, &tensor)])?;
        buffer.bytes()?;
        buffer.upload(&link, &[(0, &tensor)])?;
        buffer.bytes()?;
        fastest = fastest.min(started.elapsed().as_secs_f64());
    }
    Ok((fastest > 0.0).then(|| 2.0 * MEASURE_BYTES as f64 / fastest / 1e9))
}

/// The dtypes a host transfer carries.
pub fn supported(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A round trip through a buffer: tensors of three dtypes download to their offsets, the
    /// host reads and changes them there, and the upload overwrites other tensors in place.
    #[test]
    fn tensors_round_trip_through_a_host_buffer_at_aligned_offsets() -> Result<()> {
        let dev = Device::Cpu;
        let link = Link::new(&dev)?;
        let a = Tensor::arange(0f32, 5.0, &dev)?;
        let b = Tensor::arange(0f32, 7.0, &dev)?.to_dtype(DType::BF16)?;
        let c = Tensor::arange(0f32, 3.0, &dev)?.to_dtype(DType::F16)?;
        let sizes = [5 * 4, 7 * 2, 3 * 2];
        let (at, total) = layout(sizes);
        assert_eq!(at, vec![0, 64, 128]);
        assert_eq!(total, 192);
        let mut buf = HostBuffer::new(&link);
        buf.reserve(total)?;
        assert!(buf.capacity() >= total);
        buf.download(&link, &[(at[0], &a), (at[1], &b), (at[2], &c)])?;
        let bytes = buf.bytes()?;
        let bs: &mut [half::bf16] = typed_mut(&mut bytes[at[1]..at[1] + sizes[1]])?;
        assert_eq!(bs[6].to_f32(), 6.0);
        bs[6] = half::bf16::from_f32(-1.0);
        let (a2, b2, c2) = (a.zeros_like()?, b.zeros_like()?, c.zeros_like()?);
        buf.upload(&link, &[(at[0], &a2), (at[1], &b2), (at[2], &c2)])?;
        assert_eq!(a2.to_vec1::<f32>()?, vec![0.0, 1.0, 2.0, 3.0, 4.0]);
        let b2 = b2.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        assert_eq!(b2, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, -1.0]);
        assert_eq!(
            c2.to_dtype(DType::F32)?.to_vec1::<f32>()?,
            vec![0.0, 1.0, 2.0]
        );
        Ok(())
    }

    /// A copy outside the buffer, or at an unaligned offset, is an error, not a write.
    #[test]
    fn a_copy_that_does_not_fit_is_refused() -> Result<()> {
        let dev = Device::Cpu;
        let link = Link::new(&dev)?;
        let mut buf = HostBuffer::new(&link);
        buf.reserve(64)?;
        let big = Tensor::zeros(17, DType::F32, &dev)?;
        assert!(buf.download(&link, &[(0, &big)]).is_err());
        let small = Tensor::zeros(2, DType::F32, &dev)?;
        assert!(buf.download(&link, &[(8, &small)]).is_err());
        assert!(buf.upload(&link, &[(0, &big)]).is_err());
        Ok(())
    }
}
