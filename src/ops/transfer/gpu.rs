//! Page-locked host buffers and the copy stream (see the parent module).

#![allow(unsafe_code)]

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::cudarc::driver::{
    result, CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut,
};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, InplaceOp1, Layout, Storage, Tensor};

use crate::backend::host_memory;
use crate::{Error, Result};

/// The stream the copies are queued on: candle's own, so that each copy is ordered after the
/// kernels queued before it and before those queued after it with no cross-stream events.
/// The device runs a copy between two kernels rather than beside them; the host, which waits
/// only for the events of its own buffers, never waits for the device's other work.
pub(super) struct Streams {
    copies: Arc<CudaStream>,
}

impl Streams {
    pub(super) fn new(dev: &CudaDevice) -> Result<Self> {
        Ok(Self {
            copies: dev.cuda_stream(),
        })
    }

    pub(super) fn bind_to_thread(&self) -> Result<()> {
        Ok(self.copies.context().bind_to_thread().w()?)
    }

    /// An event after the copies queued so far, that the host can wait on without spinning.
    fn copies_done(&self) -> Result<CudaEvent> {
        Ok(self
            .copies
            .record_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .w()?)
    }
}

/// Page-locked host memory, with the event of the last copy queued on it.
pub(super) struct Pinned {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
    pending: Option<CudaEvent>,
}

// SAFETY: the memory is owned by this value alone (no other pointer to it escapes), so moving
// it to another thread moves the only access; the CUDA context and events are thread-safe.
unsafe impl Send for Pinned {}

impl Pinned {
    pub(super) fn empty(streams: &Streams) -> Self {
        Self {
            ctx: streams.copies.context().clone(),
            ptr: std::ptr::null_mut(),
            len: 0,
            pending: None,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    fn wait(&mut self) -> Result<()> {
        if let Some(event) = self.pending.take() {
            event.synchronize().w()?;
        }
        Ok(())
    }

    /// Frees the memory (after its copies) and allocates `bytes` afresh.
    pub(super) fn reallocate(&mut self, bytes: usize) -> Result<()> {
        self.release()?;
        self.ctx.bind_to_thread().w()?;
        tracing::trace!(target: "autotune::offload", bytes, "page-locking");
        // SAFETY: a plain page-locked allocation (no flags: cached, readable by the host); the
        // context is current on this thread.
        let ptr = unsafe { result::malloc_host(bytes, 0) }.w()?;
        if ptr.is_null() {
            return Err(Error::internal(format!(
                "page-locking {bytes} bytes of host memory failed"
            )));
        }
        self.ptr = ptr.cast();
        self.len = bytes;
        host_memory::external_grew(bytes);
        Ok(())
    }

    fn release(&mut self) -> Result<()> {
        self.wait()?;
        if !self.ptr.is_null() {
            self.ctx.bind_to_thread().w()?;
            // SAFETY: `ptr` came from `malloc_host` and no copy uses it any more (waited above).
            unsafe { result::free_host(self.ptr.cast()) }.w()?;
            host_memory::external_shrank(self.len);
            self.ptr = std::ptr::null_mut();
            self.len = 0;
        }
        Ok(())
    }

    pub(super) fn bytes(&mut self) -> Result<&mut [u8]> {
        self.wait()?;
        if self.ptr.is_null() {
            return Ok(&mut []);
        }
        // SAFETY: `len` bytes at `ptr` are ours, no copy is in flight (waited above), and the
        // slice borrows `self` mutably, so no other view or copy can start while it lives.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    pub(super) fn download(
        &mut self,
        streams: &Streams,
        tensors: &[(usize, &Tensor)],
    ) -> Result<()> {
        for &(at, t) in tensors {
            let (storage, layout) = t.storage_and_layout();
            let Storage::Cuda(cuda) = &*storage else {
                return Err(Error::internal("a host tensor on a device link"));
            };
            let (src, n) = address(cuda, layout, &streams.copies)?;
            // SAFETY: `at + n` is within the buffer (checked by the caller); no host view of it
            // lives while `self` is borrowed here, and the host waits on the event below before
            // it reads. The source is `n` bytes of a live device tensor, which the caller keeps
            // until then.
            unsafe {
                let dst = std::slice::from_raw_parts_mut(self.ptr.add(at), n);
                result::memcpy_dtoh_async(dst, src, streams.copies.cu_stream()).w()?;
            }
        }
        self.pending = Some(streams.copies_done()?);
        Ok(())
    }

    pub(super) fn upload(&mut self, streams: &Streams, targets: &[(usize, &Tensor)]) -> Result<()> {
        for &(at, t) in targets {
            let n = t.elem_count() * t.dtype().size_in_bytes();
            // SAFETY: `at + n` is within the buffer (checked by the caller) and the host does
            // not write it until the event below has passed.
            let src = unsafe { std::slice::from_raw_parts(self.ptr.add(at), n) };
            t.inplace_op1(&UploadAsync {
                src,
                copies: &streams.copies,
            })?;
        }
        self.pending = Some(streams.copies_done()?);
        Ok(())
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // An error here (a failed device) has nowhere to go; the memory is leaked then.
        let _ = self.release();
    }
}

/// A contiguous float tensor's device address and byte length.
fn address(cuda: &CudaStorage, layout: &Layout, stream: &Arc<CudaStream>) -> Result<(u64, usize)> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(Error::internal("a strided tensor in a host transfer"));
    };
    let (base, elem) = match &cuda.slice {
        CudaStorageSlice::F32(s) => (s.device_ptr(stream).0, 4),
        CudaStorageSlice::BF16(s) => (s.device_ptr(stream).0, 2),
        CudaStorageSlice::F16(s) => (s.device_ptr(stream).0, 2),
        CudaStorageSlice::U8(s) => (s.device_ptr(stream).0, 1),
        _ => return Err(Error::internal("a non-float tensor in a host transfer")),
    };
    Ok((base + (start * elem) as u64, (end - start) * elem))
}

/// Queues a copy of page-locked host bytes into a tensor's storage on the copy stream.
struct UploadAsync<'a> {
    src: &'a [u8],
    copies: &'a Arc<CudaStream>,
}

impl InplaceOp1 for UploadAsync<'_> {
    fn name(&self) -> &'static str {
        "host-upload"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("host-upload: a page-locked buffer uploads to CUDA tensors only")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("host-upload: the target must be contiguous");
        };
        let stream = self.copies;
        let (base, elem) = match &mut storage.slice {
            CudaStorageSlice::F32(s) => (s.device_ptr_mut(stream).0, 4),
            CudaStorageSlice::BF16(s) => (s.device_ptr_mut(stream).0, 2),
            CudaStorageSlice::F16(s) => (s.device_ptr_mut(stream).0, 2),
            CudaStorageSlice::U8(s) => (s.device_ptr_mut(stream).0, 1),
            _ => candle_core::bail!("host-upload: a non-float target"),
        };
        if (end - start) * elem != self.src.len() {
            candle_core::bail!(
                "host-upload: {} bytes for {} elements of {elem}",
                self.src.len(),
                end - start
            );
        }
        // SAFETY: the destination is the target's own `end - start` elements; the source is
        // page-locked memory that stays unchanged until the copy's event has passed.
        unsafe {
            result::memcpy_htod_async(base + (start * elem) as u64, self.src, stream.cu_stream())
        }
        .w()?;
        Ok(())
    }
}
