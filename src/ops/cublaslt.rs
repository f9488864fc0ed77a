//! One cuBLASLt matrix product on candle's stream, with what its epilogue may add: a bias per
//! output feature and a matrix summed in (β = 1). The fp8 products ([`super::fp8`]) and the
//! fused linear layers ([`super::fused_linear`]) both go through [`Product::run`], which asks
//! cuBLASLt's heuristic for an algorithm once per description of a product and keeps its answer.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::result as driver_result;
use candle_core::cuda_backend::cudarc::driver::sys::CUdeviceptr;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Result, Tensor};

use crate::ops::cuda;

/// A cuBLASLt handle and its workspace for one device, made once and kept for the process.
///
/// The workspace is allocated outside the memory pool (`cuMemAlloc`), as cuBLAS's own is: the
/// pool then holds only tensors, so a trial's pool peak is its own and a probe worker's pool is
/// empty after each trial. Inside the pool, this one process-long allocation was left over
/// after every trial, and every trial retired its worker.
struct Handle {
    handle: sys::cublasLtHandle_t,
    workspace: CUdeviceptr,
}

// SAFETY: a cuBLASLt handle may be used from any thread; calls on it are serialised by the
// stream they are issued on (candle's), and the map below hands out shared references only.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

/// NVIDIA's recommended workspace for Hopper, enough for Ada.
const WORKSPACE_BYTES: usize = 32 << 20;

fn handle(dev: &CudaDevice) -> Result<&'static Handle> {
    static HANDLES: OnceLock<Mutex<HashMap<candle_core::cuda_backend::DeviceId, &'static Handle>>> =
        OnceLock::new();
    let mut handles = HANDLES
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| candle_core::Error::Msg("cuBLASLt: a product panicked".into()))?;
    if let Some(h) = handles.get(&dev.id()) {
        return Ok(h);
    }
    dev.cuda_stream().context().bind_to_thread().w()?;
    // SAFETY: a plain device allocation of WORKSPACE_BYTES, freed below only if no handle can
    // be made, else kept for the process and only handed to cuBLASLt as scratch memory on
    // candle's stream. A failure keeps the driver's status, so that an out-of-memory here is
    // one for the trial too.
    let workspace = unsafe { driver_result::malloc_sync(WORKSPACE_BYTES) }.w()?;
    let handle = match lt::create_handle() {
        Ok(handle) => handle,
        Err(e) => {
            // SAFETY: allocated just above, and not handed to anything yet.
            let _ = unsafe { driver_result::free_sync(workspace) };
            return Err(lt_error("cuBLASLt", "a handle", e));
        }
    };
    // Kept for the process: products on this device reuse it.
    let made: &'static Handle = Box::leak(Box::new(Handle { handle, workspace }));
    handles.insert(dev.id(), made);
    Ok(made)
}

/// Everything of a product that cuBLASLt's heuristic reads: its device, shape and types, its
/// scales and epilogue, and the alignment of each matrix's address. The heuristic answers the
/// same for the same description, so it is asked once per description for the process (the
/// fp8 products of a step ask hundreds of times otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Description {
    device: candle_core::cuda_backend::DeviceId,
    shape: [u64; 3],
    types: [sys::cudaDataType_t; 3],
    scaled: [bool; 2],
    bias: Option<sys::cudaDataType_t>,
    summed: bool,
    alignments: [u32; 4],
}

/// The algorithm cuBLASLt chose for each description, or why it had none.
type Chosen = std::result::Result<sys::cublasLtMatmulAlgo_t, String>;

fn chosen() -> Result<std::sync::MutexGuard<'static, HashMap<Description, Chosen>>> {
    static CHOSEN: OnceLock<Mutex<HashMap<Description, Chosen>>> = OnceLock::new();
    CHOSEN
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| candle_core::Error::Msg("cuBLASLt: a product panicked".into()))
}

/// cuBLASLt's refusal of the step `what` of `op`'s product, so that it says which it was.
fn lt_error(op: &str, what: &str, e: lt::CublasError) -> candle_core::Error {
    candle_core::Error::Msg(format!("{op}: cuBLASLt refused {what}: {e:?}"))
}

/// cuBLASLt's name for a tensor element type.
pub(crate) fn data_type(dtype: DType) -> Option<sys::cudaDataType_t> {
    match dtype {
        DType::BF16 => Some(sys::cudaDataType_t::CUDA_R_16BF),
        DType::F16 => Some(sys::cudaDataType_t::CUDA_R_16F),
        DType::F32 => Some(sys::cudaDataType_t::CUDA_R_32F),
        _ => None,
    }
}

/// A `shape` tensor of `dtype` (bf16, f16 or f32) whose elements are not yet written: the
/// product writes every one, so zeroing it first would be a wasted pass.
pub(crate) fn unwritten(dev: &CudaDevice, shape: (usize, usize), dtype: DType) -> Result<Tensor> {
    let n = shape.0 * shape.1;
    // SAFETY (each arm): the product launched right after on the same stream writes all n
    // elements before anything can read them.
    let storage = match dtype {
        DType::BF16 => CudaStorage::wrap_cuda_slice(
            unsafe { cuda::output::<half::bf16>(dev, n) }?,
            dev.clone(),
        ),
        DType::F16 => {
            CudaStorage::wrap_cuda_slice(unsafe { cuda::output::<half::f16>(dev, n) }?, dev.clone())
        }
        DType::F32 => {
            CudaStorage::wrap_cuda_slice(unsafe { cuda::output::<f32>(dev, n) }?, dev.clone())
        }
        other => candle_core::bail!("cuBLASLt: no output of {other:?}"),
    };
    Ok(Tensor::from_storage(
        candle_core::Storage::Cuda(storage),
        shape,
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// A matrix operand: its address, its element type, and (fp8) the address of the one f32 its
/// values are multiplied by.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operand {
    pub(crate) address: u64,
    pub(crate) data_type: sys::cudaDataType_t,
    pub(crate) scale: Option<u64>,
}

/// One column-major `D (rows × cols) = Aᵀ B [+ bias] [+ C]`, with `A` stored `inner × rows` and
/// `B` `inner × cols` ("TN"). A row-major `x · Wᵀ` of `x (m × k)` and `W (n × k)` is this with
/// `A = W`, `B = x`, `rows = n`, `cols = m`: `D` is then the row-major `m × n` result.
pub(crate) struct Product {
    /// Names the caller in errors.
    pub(crate) op: &'static str,
    pub(crate) rows: u64,
    pub(crate) cols: u64,
    pub(crate) inner: u64,
    pub(crate) a: Operand,
    pub(crate) b: Operand,
    /// D's address and element type.
    pub(crate) d: (u64, sys::cudaDataType_t),
    /// A vector of `rows` values (address, element type) added to every column of D.
    pub(crate) bias: Option<(u64, sys::cudaDataType_t)>,
    /// A matrix laid out as D, of D's type, summed into it (β = 1).
    pub(crate) summed: Option<u64>,
}

/// What became of a product: queued, or refused because cuBLASLt has no kernel for it on this
/// GPU (its shape, types or epilogue), which a caller with another way to compute it expects.
#[derive(Debug)]
pub(crate) enum Queued {
    Yes,
    NoKernel(String),
}

impl Product {
    /// Queues the product on `dev`'s stream, or says that cuBLASLt has no kernel for it.
    ///
    /// # Safety
    ///
    /// The addresses must hold the matrices, vectors and scales `self` describes, on `dev`, and
    /// stay alive until candle's stream has run the product.
    pub(crate) unsafe fn run(&self, dev: &CudaDevice) -> Result<Queued> {
        // cuBLASLt works in the calling thread's current context: make it this device's.
        dev.cuda_stream()
            .context()
            .bind_to_thread()
            .map_err(|e| candle_core::Error::Msg(format!("{}: {e:?}", self.op)))?;
        let lt = handle(dev)?;
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(|e| lt_error(self.op, "a product description", e))?;
        let layouts = [
            lt::create_matrix_layout(self.a.data_type, self.inner, self.rows, self.inner as i64),
            lt::create_matrix_layout(self.b.data_type, self.inner, self.cols, self.inner as i64),
            lt::create_matrix_layout(self.d.1, self.rows, self.cols, self.rows as i64),
        ];
        let result = match layouts {
            [Ok(a), Ok(b), Ok(d)] => {
                // SAFETY: forwarded from the caller; the descriptors are live until destroyed
                // below.
                unsafe { self.run_with(lt, dev, desc, [a, b, d]) }
            }
            _ => Err(candle_core::Error::Msg(format!(
                "{}: cuBLASLt could not describe a matrix",
                self.op
            ))),
        };
        for layout in layouts.iter().flatten() {
            // SAFETY: made above, destroyed once.
            let _ = unsafe { lt::destroy_matrix_layout(*layout) };
        }
        // SAFETY: made above, destroyed once.
        let _ = unsafe { lt::destroy_matmul_desc(desc) };
        result
    }

    /// # Safety
    ///
    /// As [`Product::run`]; `desc` and `layouts` (A, B, D) are live descriptors.
    unsafe fn run_with(
        &self,
        lt: &Handle,
        dev: &CudaDevice,
        desc: sys::cublasLtMatmulDesc_t,
        [a, b, d]: [sys::cublasLtMatrixLayout_t; 3],
    ) -> Result<Queued> {
        // SAFETY: a live description.
        unsafe { self.describe(desc) }?;
        let description = self.description(dev);
        let known = chosen()?.get(&description).cloned();
        let algo = match known {
            Some(known) => known,
            None => {
                // SAFETY: live descriptors.
                let asked = unsafe { self.heuristic(lt, desc, [a, b, d]) }?;
                chosen()?.insert(description, asked.clone());
                asked
            }
        };
        let algo = match algo {
            Ok(algo) => algo,
            Err(why) => return Ok(Queued::NoKernel(why)),
        };
        let alpha = 1f32;
        let beta = if self.summed.is_some() { 1f32 } else { 0f32 };
        let c = self.c_address();
        let stream = dev.cuda_stream();
        let workspace = lt.workspace;
        // SAFETY: forwarded from the caller.
        let product = unsafe {
            lt::matmul(
                lt.handle,
                desc,
                (&raw const alpha).cast(),
                (&raw const beta).cast(),
                self.a.address as *const c_void,
                a,
                self.b.address as *const c_void,
                b,
                c as *const c_void,
                d,
                self.d.0 as *mut c_void,
                d,
                &raw const algo,
                workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as *mut _,
            )
        };
        match product {
            Ok(()) => Ok(Queued::Yes),
            // The heuristic offered an algorithm that the product then refuses for these
            // operands: as much a missing kernel as no algorithm at all, and so remembered.
            Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => {
                let why = "the product refused the heuristic's algorithm".to_string();
                chosen()?.insert(description, Err(why.clone()));
                Ok(Queued::NoKernel(why))
            }
            Err(e) => Err(lt_error(self.op, "the product", e)),
        }
    }

    /// C's address: the matrix summed in, or without one D's, which β = 0 leaves unread.
    fn c_address(&self) -> u64 {
        self.summed.unwrap_or(self.d.0)
    }

    /// The alignment of A's, B's, C's and D's addresses, which the heuristic is told.
    fn alignments(&self) -> [u32; 4] {
        [self.a.address, self.b.address, self.c_address(), self.d.0].map(address_alignment)
    }

    /// What of this product the heuristic reads, on `dev`.
    fn description(&self, dev: &CudaDevice) -> Description {
        Description {
            device: dev.id(),
            shape: [self.rows, self.cols, self.inner],
            types: [self.a.data_type, self.b.data_type, self.d.1],
            scaled: [self.a.scale.is_some(), self.b.scale.is_some()],
            bias: self.bias.map(|(_, data_type)| data_type),
            summed: self.summed.is_some(),
            alignments: self.alignments(),
        }
    }

    /// cuBLASLt's best algorithm for the described product, or why it has none.
    ///
    /// # Safety
    ///
    /// `desc` and `layouts` (A, B, D) are live descriptors.
    unsafe fn heuristic(
        &self,
        lt: &Handle,
        desc: sys::cublasLtMatmulDesc_t,
        [a, b, d]: [sys::cublasLtMatrixLayout_t; 3],
    ) -> Result<Chosen> {
        let pref = lt::create_matmul_pref().map_err(|e| lt_error(self.op, "a preference", e))?;
        // SAFETY: a live preference.
        let heuristic = unsafe { self.prefer(pref) }
            // SAFETY: live descriptors and preference; C is laid out as D.
            .and_then(|()| unsafe {
                lt::get_matmul_algo_heuristic(lt.handle, desc, a, b, d, d, pref)
            });
        // SAFETY: made above, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        Ok(heuristic.map(|h| h.algo).map_err(|e| format!("{e:?}")))
    }

    /// Sets the description's transposes ("TN"), scales and epilogue.
    ///
    /// # Safety
    ///
    /// `desc` is a live description.
    unsafe fn describe(&self, desc: sys::cublasLtMatmulDesc_t) -> Result<()> {
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        let set = |attr: Attr, value: *const c_void, size: usize| {
            // SAFETY: `value` points at `size` bytes of the attribute's type.
            unsafe { lt::set_matmul_desc_attribute(desc, attr, value, size) }
                .map_err(|e| lt_error(self.op, &format!("{attr:?}"), e))
        };
        let (transposed, plain) = (1i32, 0i32);
        set(
            Attr::CUBLASLT_MATMUL_DESC_TRANSA,
            (&raw const transposed).cast(),
            4,
        )?;
        set(
            Attr::CUBLASLT_MATMUL_DESC_TRANSB,
            (&raw const plain).cast(),
            4,
        )?;
        let pointer = std::mem::size_of::<u64>();
        for (attr, scale) in [
            (Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &self.a.scale),
            (Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &self.b.scale),
        ] {
            if let Some(address) = scale {
                set(attr, (address as *const u64).cast(), pointer)?;
            }
        }
        if let Some((address, data_type)) = &self.bias {
            let epilogue = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
            set(
                Attr::CUBLASLT_MATMUL_DESC_EPILOGUE,
                (&raw const epilogue).cast(),
                std::mem::size_of::<sys::cublasLtEpilogue_t>(),
            )?;
            set(
                Attr::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                (address as *const u64).cast(),
                pointer,
            )?;
            set(
                Attr::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                (data_type as *const sys::cudaDataType_t).cast(),
                std::mem::size_of::<sys::cudaDataType_t>(),
            )?;
        }
        Ok(())
    }

    /// Sets `pref`'s workspace and the alignment of each matrix's address: cuBLASLt assumes
    /// 256 bytes unless told, and refuses at the product a kernel the addresses do not suit.
    ///
    /// # Safety
    ///
    /// `pref` is a live preference.
    unsafe fn prefer(
        &self,
        pref: sys::cublasLtMatmulPreference_t,
    ) -> std::result::Result<(), lt::CublasError> {
        use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
        let size = WORKSPACE_BYTES;
        // SAFETY: a live preference and a usize attribute.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&raw const size).cast(),
                std::mem::size_of::<usize>(),
            )
        }?;
        let attributes = [
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        ];
        for (attr, alignment) in attributes.into_iter().zip(self.alignments()) {
            // SAFETY: a live preference and a u32 attribute.
            unsafe {
                lt::set_matmul_pref_attribute(
                    pref,
                    attr,
                    (&raw const alignment).cast(),
                    std::mem::size_of::<u32>(),
                )
            }?;
        }
        Ok(())
    }
}

/// The largest power of two, up to 256, that divides `address`.
fn address_alignment(address: u64) -> u32 {
    1u32 << address.trailing_zeros().min(8)
}
