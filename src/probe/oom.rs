//! Recognising a device out-of-memory by the error's kind, not by words in its text.
//!
//! candle has no out-of-memory variant: the driver's `CUDA_ERROR_OUT_OF_MEMORY` and cuBLAS's
//! `CUBLAS_STATUS_ALLOC_FAILED` arrive boxed inside `candle_core::Error::Cuda`, possibly under
//! backtrace, context or path layers. Those layers are unwrapped and the boxed error is
//! downcast to cudarc's `DriverError` or `CublasError` and its status compared. Only where
//! candle kept nothing but a message (`Error::Wrapped`), or where there is no error at all (a
//! dead child's last line on stderr), is the text read, and then only for the two status
//! names: an error that merely says "out of memory" (a file named so, a host allocation) is
//! not a device out-of-memory.

use crate::Error;

/// Whether `error` is a device allocation failure.
pub fn is_out_of_memory(error: &Error) -> bool {
    match error {
        Error::Backend(e) => backend_out_of_memory(e),
        _ => false,
    }
}

/// Whether a text names one of the device allocation failure statuses.
pub fn names_out_of_memory_status(text: &str) -> bool {
    text.contains("CUDA_ERROR_OUT_OF_MEMORY") || text.contains("CUBLAS_STATUS_ALLOC_FAILED")
}

fn backend_out_of_memory(error: &candle_core::Error) -> bool {
    use candle_core::Error as E;
    match error {
        E::WithBacktrace { inner, .. } | E::Context { inner, .. } | E::WithPath { inner, .. } => {
            backend_out_of_memory(inner)
        }
        E::Cuda(inner) => chain_out_of_memory(inner.as_ref()),
        E::WrappedContext { wrapped, .. } => chain_out_of_memory(wrapped.as_ref()),
        // Only a message survives here; the status names are the kind.
        E::Wrapped(inner) => names_out_of_memory_status(&inner.to_string()),
        _ => false,
    }
}

/// Whether `error` or one of its sources is an out-of-memory status.
fn chain_out_of_memory(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if is_out_of_memory_status(e) {
            return true;
        }
        next = e.source();
    }
    false
}

#[cfg(feature = "cuda")]
fn is_out_of_memory_status(error: &(dyn std::error::Error + 'static)) -> bool {
    use candle_core::cuda_backend::cudarc::{cublas, driver};
    use candle_core::cuda_backend::CudaError;
    let driver = |e: &driver::DriverError| e.0 == driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY;
    let cublas = |e: &cublas::result::CublasError| {
        e.0 == cublas::sys::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED
    };
    if let Some(e) = error.downcast_ref::<driver::DriverError>() {
        return driver(e);
    }
    if let Some(e) = error.downcast_ref::<cublas::result::CublasError>() {
        return cublas(e);
    }
    match error.downcast_ref::<CudaError>() {
        Some(CudaError::Cuda(e)) => driver(e),
        Some(CudaError::Cublas(e)) => cublas(e),
        _ => false,
    }
}

#[cfg(not(feature = "cuda"))]
fn is_out_of_memory_status(_: &(dyn std::error::Error + 'static)) -> bool {
    // Without CUDA no backend error is a device allocation failure: the CPU allocator aborts.
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn driver_out_of_memory() -> candle_core::Error {
        candle_core::Error::Wrapped(Box::new(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")",
        ))
    }

    #[test]
    fn words_are_not_a_kind_and_the_status_names_are() {
        let said = |text: &str| Error::Backend(candle_core::Error::Msg(text.into()));
        assert!(!is_out_of_memory(&said("out of memory")));
        assert!(!is_out_of_memory(&Error::Data {
            source_name: "out of memory.txt".into(),
            problem: "cannot read: out of memory".into(),
        }));
        assert!(is_out_of_memory(&Error::Backend(driver_out_of_memory())));
        let deep = candle_core::Error::Context {
            inner: Box::new(driver_out_of_memory()),
            context: Box::new("while allocating"),
        };
        assert!(is_out_of_memory(&Error::Backend(deep)));
        assert!(!names_out_of_memory_status(
            "thread panicked: out of memory"
        ));
    }
}
