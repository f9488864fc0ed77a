//! `residual + x · Wᵀ + b` as one matrix product on a GPU: cuBLASLt adds the bias and sums the
//! residual in the product's epilogue, so the output is written once, where a separate pass
//! ([`super::epilogue`]) would read it back and write it again. On gpt-124m those passes took
//! 4.45 ms of a 53.5 ms step on an H100, each at the memory's speed.
//!
//! The sum is the separate pass's up to rounding, and rounds once instead of twice: the product
//! is not rounded to the compute dtype before the bias and the residual are added. The bias is
//! in the output's dtype, as cuBLASLt's half-precision kernels read it (an f32 bias has no
//! kernel there), so it is rounded once more than the separate pass's f32 bias; the caller
//! casts it once per pass. Activations and dropout stay in [`super::epilogue`]: the caller
//! fuses only what has neither.

use candle_core::{DType, Result, Tensor};

/// What a fused product is asked to compute, in the terms that decide whether it can.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    /// Whether every tensor is on one GPU.
    pub(crate) on_gpu: bool,
    /// The input's and the weight's element type.
    pub(crate) dtypes: (DType, DType),
    /// `x`'s rows and columns, and `W`'s.
    pub(crate) x: (usize, usize),
    pub(crate) w: (usize, usize),
    /// The bias's element type and length.
    pub(crate) bias: Option<(DType, usize)>,
    /// The residual's element type and shape.
    pub(crate) residual: Option<(DType, (usize, usize))>,
}

impl Request {
    /// Whether cuBLASLt's epilogue computes it: on a GPU, half-precision operands of one dtype,
    /// an inner and an output dimension that are multiples of 8 (the tensor-core kernels' rows
    /// of 16 bytes), a bias of the output's dtype and width, a residual of the output's dtype
    /// and shape, and something to fuse (a bare product stays with candle's).
    pub(crate) fn fusable(&self) -> bool {
        let (dx, dw) = self.dtypes;
        let half = matches!(dx, DType::BF16 | DType::F16) && dx == dw;
        let ((m, k), (n, k_w)) = (self.x, self.w);
        let shapes = k == k_w && k % 8 == 0 && n % 8 == 0 && m > 0;
        let bias = self.bias.is_none_or(|(dtype, len)| dtype == dx && len == n);
        let residual = self
            .residual
            .is_none_or(|(dtype, shape)| dtype == dx && shape == (m, n));
        let something = self.bias.is_some() || self.residual.is_some();
        self.on_gpu && half && shapes && bias && residual && something
    }
}

/// What became of a fused product: computed, or left to the caller's separate passes (the
/// product, then [`super::epilogue()`]) for the reason given.
#[derive(Debug)]
pub enum FusedLinear {
    /// The product with its bias and residual added.
    Computed(Tensor),
    /// The request is outside what the epilogue computes exactly: see [`fused_linear`].
    NotFusable,
    /// cuBLASLt has no kernel for it on this GPU; cuBLASLt's answer.
    NoKernel(String),
}

impl FusedLinear {
    /// The output, where the product was fused.
    pub fn computed(self) -> Option<Tensor> {
        match self {
            Self::Computed(t) => Some(t),
            Self::NotFusable | Self::NoKernel(_) => None,
        }
    }
}

/// `residual + x · wᵀ + bias` for `x (m × k)` and `w (n × k)`, in one cuBLASLt product, where
/// that applies: on a GPU, in bf16 or f16, widths that are multiples of 8, a bias of `n`
/// values and a residual of the output's dtype and shape, something to add, and a cuBLASLt
/// kernel for it on this GPU. Every tensor is made contiguous first.
pub fn fused_linear(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<FusedLinear> {
    let (Ok(xs), Ok(ws)) = (x.dims2(), w.dims2()) else {
        return Ok(FusedLinear::NotFusable);
    };
    let on_gpu = |t: &Tensor| t.device().is_cuda() && t.device().same_device(x.device());
    let request = Request {
        on_gpu: on_gpu(w)
            && bias.is_none_or(on_gpu)
            && residual.is_none_or(on_gpu)
            && x.device().is_cuda(),
        dtypes: (x.dtype(), w.dtype()),
        x: xs,
        w: ws,
        bias: bias.map(|b| (b.dtype(), b.elem_count())),
        residual: residual.and_then(|r| Some((r.dtype(), r.dims2().ok()?))),
    };
    if !request.fusable() {
        return Ok(FusedLinear::NotFusable);
    }
    #[cfg(feature = "cuda")]
    {
        gpu::product(x, w, bias, residual)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Ok(FusedLinear::NotFusable)
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    #![allow(unsafe_code)]

    use candle_core::{bail, Result, Tensor};

    use super::FusedLinear;
    use crate::ops::cublaslt::{data_type, unwritten, Operand, Product, Queued};
    use crate::ops::cuda;

    const NAME: &str = "fused linear";

    /// The product of a request [`super::Request::fusable`] accepted, or cuBLASLt's refusal
    /// where it has no kernel for it on this GPU (the caller's separate passes then run).
    pub(super) fn product(
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        residual: Option<&Tensor>,
    ) -> Result<FusedLinear> {
        let candle_core::Device::Cuda(dev) = x.device() else {
            bail!("{NAME}: the input is not on a GPU");
        };
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        let bias = bias.map(|b| b.contiguous()).transpose()?;
        let residual = residual.map(|r| r.contiguous()).transpose()?;
        let ((m, k), (n, _)) = (x.dims2()?, w.dims2()?);
        let Some(half) = data_type(x.dtype()) else {
            bail!("{NAME}: no cuBLASLt type for {:?}", x.dtype());
        };
        let out = unwritten(dev, (m, n), x.dtype())?;
        let address = |t: &Tensor| cuda::address(t, NAME);
        let operand = |t: &Tensor| -> Result<Operand> {
            Ok(Operand {
                address: address(t)?,
                data_type: half,
                scale: None,
            })
        };
        let call = Product {
            op: NAME,
            rows: n as u64,
            cols: m as u64,
            inner: k as u64,
            a: operand(&w)?,
            b: operand(&x)?,
            d: (address(&out)?, half),
            // The bias is of the output's dtype (`Request::fusable`).
            bias: match &bias {
                Some(b) => Some((address(b)?, half)),
                None => None,
            },
            summed: residual.as_ref().map(address).transpose()?,
        };
        // SAFETY: the addresses come from live, contiguous tensors of the checked shapes and
        // dtypes (`Request::fusable`): `w` n·k and `x` m·k half-precision values, `out` and the
        // residual m·n, the bias n values of the output's dtype; all stay alive past the
        // queued product, since candle's pool reuses memory in the order of this same stream.
        match unsafe { call.run(dev) }? {
            Queued::Yes => Ok(FusedLinear::Computed(out)),
            Queued::NoKernel(why) => {
                tracing::debug!(
                    target: "autotune::ops",
                    m, n, k, why,
                    "cuBLASLt has no fused linear product here; the bias and residual run apart"
                );
                Ok(FusedLinear::NoKernel(why))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> Request {
        Request {
            on_gpu: true,
            dtypes: (DType::BF16, DType::BF16),
            x: (4096, 768),
            w: (2304, 768),
            bias: Some((DType::BF16, 2304)),
            residual: None,
        }
    }

    #[test]
    fn only_what_the_epilogue_computes_exactly_is_fused() {
        let base = request();
        let cases: Vec<(&str, Request, bool)> = vec![
            ("a bias", base, true),
            (
                "a bias and a residual",
                Request {
                    residual: Some((DType::BF16, (4096, 2304))),
                    ..base
                },
                true,
            ),
            (
                "a residual alone",
                Request {
                    bias: None,
                    residual: Some((DType::BF16, (4096, 2304))),
                    ..base
                },
                true,
            ),
            (
                "f16",
                Request {
                    dtypes: (DType::F16, DType::F16),
                    bias: Some((DType::F16, 2304)),
                    ..base
                },
                true,
            ),
            ("nothing to fuse", Request { bias: None, ..base }, false),
            (
                "on the CPU",
                Request {
                    on_gpu: false,
                    ..base
                },
                false,
            ),
            (
                "f32 operands",
                Request {
                    dtypes: (DType::F32, DType::F32),
                    ..base
                },
                false,
            ),
            (
                "mixed dtypes",
                Request {
                    dtypes: (DType::BF16, DType::F16),
                    ..base
                },
                false,
            ),
            (
                "an odd inner width",
                Request {
                    x: (4096, 770),
                    w: (2304, 770),
                    ..base
                },
                false,
            ),
            (
                "an odd output width",
                Request {
                    w: (2300, 768),
                    bias: Some((DType::BF16, 2300)),
                    ..base
                },
                false,
            ),
            (
                "mismatched inner widths",
                Request {
                    w: (2304, 776),
                    ..base
                },
                false,
            ),
            (
                "an f32 bias (no half-precision kernel reads one)",
                Request {
                    bias: Some((DType::F32, 2304)),
                    ..base
                },
                false,
            ),
            (
                "an f16 bias with bf16 operands",
                Request {
                    bias: Some((DType::F16, 2304)),
                    ..base
                },
                false,
            ),
            (
                "a bias of another width",
                Request {
                    bias: Some((DType::BF16, 2296)),
                    ..base
                },
                false,
            ),
            (
                "a residual of another shape",
                Request {
                    residual: Some((DType::BF16, (4096, 2296))),
                    ..base
                },
                false,
            ),
            (
                "a residual of another dtype",
                Request {
                    residual: Some((DType::F32, (4096, 2304))),
                    ..base
                },
                false,
            ),
            (
                "no rows",
                Request {
                    x: (0, 768),
                    ..base
                },
                false,
            ),
        ];
        for (name, request, fused) in cases {
            assert_eq!(request.fusable(), fused, "{name}");
        }
    }

    #[test]
    fn off_a_gpu_the_caller_runs_the_separate_passes() {
        let device = candle_core::Device::Cpu;
        let x = Tensor::zeros((16, 32), DType::BF16, &device).unwrap();
        let w = Tensor::zeros((8, 32), DType::BF16, &device).unwrap();
        let b = Tensor::zeros(8, DType::BF16, &device).unwrap();
        let outcome = fused_linear(&x, &w, Some(&b), None).unwrap();
        assert!(matches!(outcome, FusedLinear::NotFusable), "{outcome:?}");
    }
}
