//! `permute(x).contiguous()` for permutations that keep the last dimension last, as one copy
//! kernel that moves 16-byte units. candle's generic strided copy computes a full index per
//! element and took ~750 µs per attention head split/merge at the seed's micro-batch 512 on an
//! H200 (a fifth of a step); the CPU path is candle's own.

use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

/// `x.permute(perm)` as a contiguous tensor; `perm` must keep the last dimension last and `x`
/// may have at most five dimensions.
pub fn permute_contiguous(x: &Tensor, perm: &[usize]) -> Result<Tensor> {
    let rank = x.rank();
    if perm.len() != rank || rank == 0 || rank > 5 || perm[rank - 1] != rank - 1 {
        bail!("permute: {perm:?} must keep the last of ≤5 dimensions last");
    }
    let view = x.permute(perm)?;
    if x.device().is_cpu() || view.is_contiguous() {
        return view.contiguous();
    }
    x.contiguous()?.apply_op1_no_bwd(&Permute {
        perm: perm.to_vec(),
    })
}

struct Permute {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    perm: Vec<usize>,
}

impl CustomOp1 for Permute {
    fn name(&self) -> &'static str {
        "permute"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("permute: the CPU path uses candle's copy")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::cuda_backend::CudaStorageSlice as S;

        let dims = l.dims();
        let rank = dims.len();
        let out_dims: Vec<usize> = self.perm.iter().map(|&p| dims[p]).collect();
        // Strides of the contiguous input, in elements.
        let mut in_strides = vec![1usize; rank];
        for k in (0..rank - 1).rev() {
            in_strides[k] = in_strides[k + 1] * dims[k + 1];
        }
        let elem = candle_core::backend::BackendStorage::dtype(s).size_in_bytes();
        // Whole 16-byte units when the innermost run and the start allow it (every outer
        // stride is a multiple of the run), else single elements.
        let vector = (dims[rank - 1] * elem) % 16 == 0 && (l.start_offset() * elem) % 16 == 0;
        let unit = if vector { 16 } else { elem };
        let per_unit = unit / elem;
        let mut d = gpu::Dims4 {
            n: [1; 4],
            stride: [0; 4],
        };
        // Output outer dims right-aligned into the four slots; missing leading ones are size 1.
        let outer = rank - 1;
        for k in 0..outer {
            d.n[4 - outer + k] = out_dims[k] as i64;
            d.stride[4 - outer + k] = (in_strides[self.perm[k]] / per_unit) as i64;
        }
        let geometry = gpu::Geometry {
            dims: d,
            inner_units: (dims[rank - 1] / per_unit) as i64,
            total_units: l.shape().elem_count() / per_unit,
            unit,
        };
        let range = l.start_offset()..l.start_offset() + l.shape().elem_count();
        let dev = &s.device;
        let slice = match &s.slice {
            S::BF16(v) => S::BF16(gpu::launch(dev, &v.slice(range), &geometry)?),
            S::F16(v) => S::F16(gpu::launch(dev, &v.slice(range), &geometry)?),
            S::F32(v) => S::F32(gpu::launch(dev, &v.slice(range), &geometry)?),
            _ => bail!("permute: expected f32, bf16 or f16"),
        };
        Ok((
            candle_core::CudaStorage {
                slice,
                device: dev.clone(),
            },
            Shape::from(out_dims),
        ))
    }
}

#[cfg(feature = "cuda")]
mod gpu;
