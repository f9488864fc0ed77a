//! The fused ops' CUDA kernels against their CPU implementations, for f32, bf16 and f16, plus
//! run-to-run reproducibility and a whole-model fused-vs-composite check on the GPU (timings are
//! in `benches/cuda_timings.rs`).
//!
//! Needs a CUDA device (ordinal 0). Each comparison prints one summary line to stderr
//! (`--nocapture` shows them): op, dtype, shape, tensor, max abs and max-relative error, the
//! tolerance. Tolerances are those of `ops.rs` (both sides compute in f32; they differ in
//! summation order, the exp implementation and, for bf16/f16, possibly one output rounding).

use candle_core::{DType, Device, Tensor, Var};

use autotune::data::source::{Data, DataSpec};
use autotune::knobs::{Knobs, Precision};
use autotune::model::Engine;
use autotune::ops;
use autotune::train::step::Trainer;

use crate::ops::{causal_mask, ce_grad_tol, errors, random, targets, tol, DTYPES};
use crate::util::{small_gpt, small_llama, small_seed};

fn gpu() -> Device {
    Device::new_cuda(0).expect("these tests need a CUDA device")
}

/// Prints the summary line and asserts the tolerance on the max-relative error.
fn check(op: &str, dtype: DType, shape: &str, what: &str, gpu: &Tensor, cpu: &Tensor, tol: f64) {
    check_scaled(op, dtype, shape, what, gpu, cpu, tol, None);
}

/// As [`check`], but the error is relative to `scale` when given instead of to max |cpu|.
#[allow(clippy::too_many_arguments)]
fn check_scaled(
    op: &str,
    dtype: DType,
    shape: &str,
    what: &str,
    gpu: &Tensor,
    cpu: &Tensor,
    tol: f64,
    scale: Option<f64>,
) {
    assert!(
        gpu.device().is_cuda(),
        "{op} {what}: result is not on the GPU"
    );
    let (abs, mut rel) = errors(gpu, cpu);
    if let Some(scale) = scale {
        rel = abs / scale;
    }
    eprintln!(
        "cuda-vs-cpu {op:<13} {:<4} {shape:<16} {what:<6} max abs {abs:9.3e}  rel {rel:9.3e}  (tol {tol:.1e})",
        format!("{dtype:?}").to_lowercase()
    );
    assert!(
        rel <= tol,
        "{op} {dtype:?} {shape} {what}: GPU vs CPU relative error {rel:e} > {tol:e}"
    );
}

/// Gradient of `Σ f(x) · w` with respect to the leaf `x`, plus `f(x)`.
fn with_grad(x: &Tensor, w: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> (Tensor, Tensor) {
    let var = Var::from_tensor(x).unwrap();
    let y = f(var.as_tensor());
    let loss = (y.to_dtype(DType::F32).unwrap() * w)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    (y, grads.get(&var).unwrap().clone())
}

#[test]
fn cuda_cross_entropy_matches_cpu() {
    let dev = gpu();
    // (rows, classes, columns: the classes then padding, scale, offset)
    let cases = [
        (1, 2, 2, 1.0, 0.0),
        (33, 1000, 1000, 3.0, 0.0),
        (33, 1000, 1024, 3.0, 0.0),
        (4096, 10_000, 10_000, 2.0, 0.0),
        (7, 10_000, 10_000, 30.0, 500.0),
        (1024, 50_257, 50_257, 2.0, 0.0),
        (1024, 50_257, 50_304, 2.0, 0.0),
    ];
    for (i, &(rows, classes, cols, scale, offset)) in cases.iter().enumerate() {
        for dtype in DTYPES {
            let shape = format!("{rows}x{classes}/{cols}");
            let logits = random(&[rows, classes], scale, offset, 10 + i as u64, dtype);
            // Padding far above the classes' values: it would dominate any sum it entered.
            let logits = if cols > classes {
                let pad = random(&[rows, cols - classes], 1.0, offset + 40.0, 30, dtype);
                Tensor::cat(&[&logits, &pad], 1).unwrap()
            } else {
                logits
            };
            let t = targets(rows, classes, 10 + i as u64);
            let w = random(&[rows], 1.0, 0.0, 20 + i as u64, DType::F32);
            let run = |device: &Device| {
                let x = logits.to_device(device).unwrap();
                let (t, w) = (t.to_device(device).unwrap(), w.to_device(device).unwrap());
                with_grad(&x, &w.unsqueeze(1).unwrap(), |x| {
                    ops::cross_entropy_rows_padded(x, &t, classes)
                        .unwrap()
                        .unsqueeze(1)
                        .unwrap()
                })
            };
            let (loss_g, dx_g) = run(&dev);
            let (loss_c, dx_c) = run(&Device::Cpu);
            check(
                "cross-entropy",
                dtype,
                &shape,
                "loss",
                &loss_g,
                &loss_c,
                1e-5,
            );
            let t = ce_grad_tol(dtype, &logits.narrow(1, 0, classes).unwrap());
            check("cross-entropy", dtype, &shape, "dx", &dx_g, &dx_c, t);
            if cols > classes {
                let pad = dx_g.narrow(1, classes, cols - classes).unwrap();
                let nonzero = pad
                    .to_dtype(DType::F32)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert_eq!(nonzero, 0.0, "{dtype:?} {shape}: padding got a gradient");
            }
        }
    }
}

#[test]
fn cuda_softmax_matches_cpu() {
    let dev = gpu();
    let cases: [(&[usize], f32, bool); 6] = [
        (&[3, 7], 1.0, false),
        (&[8, 8, 128, 128], 1.0, true),
        (&[2, 4, 33, 33], 2.0, true),
        (&[64, 1025], 1.0, false),
        (&[4, 4096], 1.0, false),
        (&[5, 64], 40.0, false),
    ];
    for (i, &(shape, scale, causal)) in cases.iter().enumerate() {
        for dtype in DTYPES {
            let name = format!("{shape:?}").replace(' ', "");
            let mut x = random(shape, scale, 0.0, 30 + i as u64, dtype);
            if causal {
                x = x
                    .broadcast_add(&causal_mask(shape[shape.len() - 1], dtype))
                    .unwrap();
            }
            let w = random(shape, 1.0, 0.0, 40 + i as u64, DType::F32);
            let run = |device: &Device| {
                let (x, w) = (x.to_device(device).unwrap(), w.to_device(device).unwrap());
                with_grad(&x, &w, |x| ops::softmax_last_dim(x).unwrap())
            };
            let (y_g, dx_g) = run(&dev);
            let (y_c, dx_c) = run(&Device::Cpu);
            check("softmax", dtype, &name, "y", &y_g, &y_c, tol(dtype));
            // dx relative to max |dy|, as in ops.rs: peaked rows cancel in dy − Σ dy·y.
            let max_dy = w
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let scale = Some(f64::from(max_dy));
            check_scaled(
                "softmax",
                dtype,
                &name,
                "dx",
                &dx_g,
                &dx_c,
                tol(dtype),
                scale,
            );
        }
    }
    // A transposed input goes through `.contiguous()` on the device.
    let x = random(&[96, 40], 1.0, 0.0, 49, DType::F32);
    let got = ops::softmax_last_dim(&x.to_device(&dev).unwrap().t().unwrap()).unwrap();
    let want = ops::softmax_last_dim(&x.t().unwrap()).unwrap();
    check(
        "softmax",
        DType::F32,
        "[40,96]ᵀ",
        "y",
        &got,
        &want,
        tol(DType::F32),
    );
}

#[test]
fn cuda_layer_norm_matches_cpu() {
    let dev = gpu();
    // Rows of a multiple of 8 values up to 8,192 run a warp per row, the others (1,001 and
    // 9,000 wide) a block per row.
    let cases: [(&[usize], f32, f32); 7] = [
        (&[5, 8], 1.0, 0.0),
        (&[37, 1000], 2.0, 0.5),
        (&[32, 128, 768], 1.0, 0.0),
        (&[16_384, 512], 1.0, 0.0),
        (&[300, 64], 0.1, 20.0),
        (&[33, 1001], 1.0, 0.0),
        (&[9, 9000], 1.0, 0.5),
    ];
    for (i, &(shape, scale, offset)) in cases.iter().enumerate() {
        for dtype in DTYPES {
            let name = format!("{shape:?}").replace(' ', "");
            let d = shape[shape.len() - 1];
            let seed = 50 + i as u64;
            let x = random(shape, scale, offset, seed, dtype);
            let w = random(shape, 1.0, 0.0, seed + 1, DType::F32);
            let gamma = random(&[d], 0.5, 1.0, seed + 2, DType::F32);
            let beta = random(&[d], 0.5, 0.0, seed + 3, DType::F32);
            let run = |device: &Device| {
                let to = |t: &Tensor| Var::from_tensor(&t.to_device(device).unwrap()).unwrap();
                let (xv, gv, bv) = (to(&x), to(&gamma), to(&beta));
                let y =
                    ops::layer_norm(xv.as_tensor(), gv.as_tensor(), bv.as_tensor(), 1e-5).unwrap();
                let w = w.to_device(device).unwrap();
                let loss = (y.to_dtype(DType::F32).unwrap() * w)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                let grads = loss.backward().unwrap();
                let get = |v: &Var| grads.get(v).unwrap().clone();
                [y.clone(), get(&xv), get(&gv), get(&bv)]
            };
            let g = run(&dev);
            let c = run(&Device::Cpu);
            // At least 1e-4 for f32: the GPU's f32 row mean vs the CPU's f64 one, magnified
            // by mean/std in the offset case (see ops.rs).
            let t = tol(dtype).max(1e-4);
            check("layer-norm", dtype, &name, "y", &g[0], &c[0], t);
            check("layer-norm", dtype, &name, "dx", &g[1], &c[1], 2.0 * t);
            check("layer-norm", dtype, &name, "dgamma", &g[2], &c[2], t);
            check("layer-norm", dtype, &name, "dbeta", &g[3], &c[3], t);
        }
    }
}

#[test]
fn cuda_backward_passes_are_bitwise_reproducible() {
    let dev = gpu();
    let x = random(&[8192, 768], 1.0, 0.0, 60, DType::BF16)
        .to_device(&dev)
        .unwrap();
    let w = random(&[8192, 768], 1.0, 0.0, 61, DType::F32)
        .to_device(&dev)
        .unwrap();
    let gamma = random(&[768], 0.5, 1.0, 62, DType::F32)
        .to_device(&dev)
        .unwrap();
    let beta = random(&[768], 0.5, 0.0, 63, DType::F32)
        .to_device(&dev)
        .unwrap();
    let t = targets(8192, 768, 64).to_device(&dev).unwrap();
    let grads = || {
        let (xv, gv, bv) = (
            Var::from_tensor(&x).unwrap(),
            Var::from_tensor(&gamma).unwrap(),
            Var::from_tensor(&beta).unwrap(),
        );
        let y = ops::layer_norm(xv.as_tensor(), gv.as_tensor(), bv.as_tensor(), 1e-5).unwrap();
        let s = ops::softmax_last_dim(&y).unwrap();
        let loss = ((s.to_dtype(DType::F32).unwrap() * &w)
            .unwrap()
            .sum_all()
            .unwrap()
            + ops::cross_entropy(&y, &t).unwrap())
        .unwrap();
        let g = loss.backward().unwrap();
        [&xv, &gv, &bv].map(|v| {
            let v: Vec<f32> = g
                .get(v)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            v.into_iter().map(f32::to_bits).collect::<Vec<_>>()
        })
    };
    let (a, b) = (grads(), grads());
    for (name, (a, b)) in ["dx", "dgamma", "dbeta"].iter().zip(a.iter().zip(&b)) {
        assert!(
            a == b,
            "{name} differs between two identical backward passes"
        );
    }
    eprintln!("cuda reproducibility: dx, dgamma, dbeta bitwise identical over two runs");
}

#[test]
fn cuda_fused_and_composite_models_agree() {
    let dev = gpu();
    for (spec, precision, grad_tol) in [
        (small_seed(0.1), Precision::Fp32, 1e-5),
        (small_gpt(), Precision::Fp32, 1e-5),
        (small_gpt(), Precision::Bf16, f64::INFINITY),
    ] {
        let data = Data::open(&DataSpec::Random, &spec).unwrap();
        let batch = data.batch(3, 0, 0, 4, &dev).unwrap();
        let run = |engine| {
            let mut trainer = Trainer::new(&spec, Knobs::new(4, precision), &dev, 3).unwrap();
            trainer.set_engine(engine);
            trainer.gradients(std::slice::from_ref(&batch)).unwrap()
        };
        let (g_f, l_f) = run(Engine::Fused);
        let (g_c, l_c) = run(Engine::Composite);
        let worst = g_f
            .iter()
            .zip(&g_c)
            .map(|(a, b)| errors(a, b).1)
            .fold(0f64, f64::max);
        eprintln!(
            "cuda model {} {precision}: loss fused {l_f:.6} composite {l_c:.6}; worst gradient rel error {worst:.3e}",
            spec.name
        );
        for g in &g_f {
            let max = g
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(
                max.is_finite() && max > 0.0,
                "a fused gradient is zero or not finite"
            );
        }
        assert!((l_f - l_c).abs() / l_c < 1e-2, "loss {l_f} vs {l_c}");
        assert!(worst <= grad_tol, "{worst:e} > {grad_tol:e}");
    }
}

/// The explicit engine on the GPU against itself on the CPU: hashed dropout masks are the same
/// on both devices, so even with dropout on the losses and every gradient must agree (f32:
/// summation order only; the embedding's float atomics included).
#[test]
fn cuda_explicit_engine_matches_the_cpu() {
    let dev = gpu();
    for spec in [
        small_seed(0.1),
        small_gpt(),
        small_llama(false),
        small_llama(true),
    ] {
        let data = Data::open(&DataSpec::Random, &spec).unwrap();
        let run = |device: &Device| {
            let batch = data.batch(3, 0, 0, 4, device).unwrap();
            let mut trainer =
                Trainer::new(&spec, Knobs::new(4, Precision::Fp32), device, 3).unwrap();
            trainer.set_engine(Engine::Explicit);
            trainer.gradients(std::slice::from_ref(&batch)).unwrap()
        };
        let (g_gpu, l_gpu) = run(&dev);
        let (g_cpu, l_cpu) = run(&Device::Cpu);
        let worst = g_gpu
            .iter()
            .zip(&g_cpu)
            .map(|(a, b)| errors(a, b).1)
            .fold(0f64, f64::max);
        eprintln!(
            "cuda explicit {}: loss gpu {l_gpu:.6} cpu {l_cpu:.6}; worst gradient rel error {worst:.3e}",
            spec.name
        );
        assert!(
            (l_gpu - l_cpu).abs() / l_cpu < 1e-5,
            "loss {l_gpu} vs {l_cpu}"
        );
        assert!(worst <= 1e-4, "{}: {worst:e}", spec.name);
    }
}

/// The decoder ops (RMS norm forward and backward, SwiGLU with bias and dropout, the rotary
/// embedding both ways) on the GPU against their CPU implementations.
#[test]
fn cuda_decoder_ops_match_the_cpu() {
    let dev = gpu();
    let mask = ops::DropoutMask { p: 0.2, key: 3 };
    for dtype in DTYPES {
        // RMS norm at Llama 3.2 1B's width, a narrower one (both a warp per row) and an odd
        // one (a block per row).
        for (rows, d) in [(300, 2048), (37, 896), (21, 1003)] {
            let x = random(&[rows, d], 2.0, 0.3, 1, dtype);
            let gamma = random(&[d], 0.5, 1.0, 2, DType::F32);
            let dy = random(&[rows, d], 1.0, 0.0, 3, dtype);
            let run = |dev: &Device| {
                let (x, g, dy) = (
                    x.to_device(dev).unwrap(),
                    gamma.to_device(dev).unwrap(),
                    dy.to_device(dev).unwrap(),
                );
                let y = ops::rms_norm(&x, &g, 1e-5).unwrap();
                let (dx, dg) = ops::rms_norm_backward(&x, &g, &dy, 1e-5).unwrap();
                (y, dx, dg)
            };
            let (g, c) = (run(&dev), run(&Device::Cpu));
            let shape = format!("{rows}x{d}");
            check("rms_norm", dtype, &shape, "y", &g.0, &c.0, tol(dtype));
            check(
                "rms_norm",
                dtype,
                &shape,
                "dx",
                &g.1,
                &c.1,
                2.0 * tol(dtype),
            );
            check(
                "rms_norm",
                dtype,
                &shape,
                "dgamma",
                &g.2,
                &c.2,
                2.0 * tol(dtype),
            );
        }
        // SwiGLU at Qwen 2.5's 4864 and an odd width, with and without bias and dropout.
        for (rows, f) in [(64, 4864), (33, 97)] {
            for (bias, drop) in [(false, None), (true, Some(mask))] {
                let h = random(&[rows, 2 * f], 2.0, 0.0, 4, dtype);
                let b = bias.then(|| random(&[2 * f], 0.5, 0.0, 5, DType::F32));
                let dout = random(&[rows, f], 1.0, 0.0, 6, dtype);
                let run = |dev: &Device| {
                    let h = h.to_device(dev).unwrap();
                    let b = b.as_ref().map(|b| b.to_device(dev).unwrap());
                    let dout = dout.to_device(dev).unwrap();
                    let y = ops::swiglu(&h, b.as_ref(), drop).unwrap();
                    let dh = ops::swiglu_backward(&dout, &h, b.as_ref(), drop).unwrap();
                    (y, dh)
                };
                let (g, c) = (run(&dev), run(&Device::Cpu));
                let shape = format!(
                    "{rows}x{f} b{} d{}",
                    u8::from(bias),
                    u8::from(drop.is_some())
                );
                check("swiglu", dtype, &shape, "y", &g.0, &c.0, tol(dtype));
                check("swiglu", dtype, &shape, "dh", &g.1, &c.1, 2.0 * tol(dtype));
            }
        }
        // Widening and in-place sums, aligned (eight at a time) and not (an odd count).
        for n in [1 << 20, 1001] {
            let part = random(&[n], 1.0, 0.0, 8, dtype);
            let acc = random(&[n], 1.0, 0.0, 9, DType::F32);
            let run = |dev: &Device| {
                let wide = ops::to_f32(&part.to_device(dev).unwrap()).unwrap();
                let sum = acc.to_device(dev).unwrap().copy().unwrap();
                ops::accumulate_into(&sum, &part.to_device(dev).unwrap()).unwrap();
                (wide, sum)
            };
            let (g, c) = (run(&dev), run(&Device::Cpu));
            check("widen", dtype, &n.to_string(), "x", &g.0, &c.0, 0.0);
            check("accumulate", dtype, &n.to_string(), "sum", &g.1, &c.1, 0.0);
            // Narrowed: bit for bit candle's cast on the CPU (both round to nearest even).
            if dtype != DType::F32 {
                let narrow = |dev: &Device| ops::to_half(&acc.to_device(dev).unwrap(), dtype);
                let (g, c) = (narrow(&dev).unwrap(), acc.to_dtype(dtype).unwrap());
                assert_eq!(g.dtype(), dtype);
                check("narrow", dtype, &n.to_string(), "x", &g, &c, 0.0);
            }
        }
        // Weight gradients summed into f32 by the product itself (cuBLAS GemmEx, β = 1), at an
        // odd shape and at one of the vocabulary head's; the CPU sums in the products' dtype.
        for (rows, out, width) in [(37, 21, 19), (512, 1024, 256)] {
            let dy = random(&[rows, out], 1.0, 0.0, 10, dtype);
            let x = random(&[rows, width], 1.0, 0.0, 11, dtype);
            let acc = random(&[out, width], 1.0, 0.0, 12, DType::F32);
            let run = |dev: &Device| {
                let sum = acc.to_device(dev).unwrap().copy().unwrap();
                let (dy, x) = (dy.to_device(dev).unwrap(), x.to_device(dev).unwrap());
                ops::accumulate_product_tn(&sum, &dy, &x).unwrap();
                ops::accumulate_product_tn(&sum, &dy, &x).unwrap();
                sum
            };
            let want = {
                let (dy, x) = (
                    dy.to_dtype(DType::F32).unwrap(),
                    x.to_dtype(DType::F32).unwrap(),
                );
                let part = dy.t().unwrap().matmul(&x).unwrap();
                ((&acc + &part).unwrap() + &part).unwrap()
            };
            let shape = format!("{rows}x{out}x{width}");
            check("weight grad", dtype, &shape, "sum", &run(&dev), &want, 1e-4);
            // The input gradient by a column block of `dy` and the matching weight rows.
            let (first, k) = (out / 3, out / 2);
            let w = random(&[k, width], 1.0, 0.0, 13, dtype);
            let acc = random(&[rows, width], 1.0, 0.0, 14, DType::F32);
            let run = |dev: &Device| {
                let sum = acc.to_device(dev).unwrap().copy().unwrap();
                let (dy, w) = (dy.to_device(dev).unwrap(), w.to_device(dev).unwrap());
                ops::accumulate_product_nn(&sum, &dy, first, &w).unwrap();
                sum
            };
            let want = {
                let dy = dy
                    .to_dtype(DType::F32)
                    .unwrap()
                    .narrow(1, first, k)
                    .unwrap();
                let part = dy
                    .contiguous()
                    .unwrap()
                    .matmul(&w.to_dtype(DType::F32).unwrap());
                (&acc + part.unwrap()).unwrap()
            };
            check("input grad", dtype, &shape, "sum", &run(&dev), &want, 1e-4);
        }
        // The rotary embedding over q and k of a q/k/v product, in place, both ways.
        let rope = autotune::spec::model::Rope {
            theta: 500_000.0,
            scaling: None,
        };
        let (b, s, heads, kv, hd) = (2, 300, 8, 2, 64);
        let freqs = rope.inverse_frequencies(hd);
        let x = random(&[b * s, (heads + 2 * kv) * hd], 1.0, 0.0, 7, dtype);
        for rotation in [ops::Rotation::Forward, ops::Rotation::Backward] {
            let run = |dev: &Device| {
                let t = x.to_device(dev).unwrap().copy().unwrap();
                let f = ops::rotary::frequencies(&freqs, dev).unwrap();
                ops::rotate_in_place(&t, &f, heads + kv, hd, s, rotation).unwrap();
                t
            };
            check(
                "rotary",
                dtype,
                &format!("{rotation:?}"),
                "x",
                &run(&dev),
                &run(&Device::Cpu),
                tol(dtype),
            );
            // Packed: each row turns by its position in its own example.
            let ids: Vec<u32> = (0..b * s).map(|r| ((r % s) % 37) as u32).collect();
            let ids = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
            let packed = |dev: &Device| {
                let t = x.to_device(dev).unwrap().copy().unwrap();
                let f = ops::rotary::frequencies(&freqs, dev).unwrap();
                let ids = ids.to_device(dev).unwrap();
                ops::rotate_packed_in_place(&t, &f, heads + kv, hd, s, rotation, &ids).unwrap();
                t
            };
            check(
                "rotary packed",
                dtype,
                &format!("{rotation:?}"),
                "x",
                &packed(&dev),
                &packed(&Device::Cpu),
                tol(dtype),
            );
        }
    }
}

/// The explicit engine's kernels (epilogue forward/backward, embedding, causal softmax) on the
/// GPU against their CPU implementations.
#[test]
fn cuda_explicit_kernels_match_the_cpu() {
    use autotune::ops::DropoutMask;
    use autotune::spec::model::Activation;
    let dev = gpu();
    let (rows, cols) = (300, 96);
    let m = Some(DropoutMask { p: 0.1, key: 77 });
    for dtype in DTYPES {
        let shape = format!("[{rows},{cols}]");
        let on = |t: &Tensor, d: &Device| t.to_dtype(dtype).unwrap().to_device(d).unwrap();
        let y = random(&[rows, cols], 1.5, 0.0, 1, DType::F32);
        let r = random(&[rows, cols], 1.0, 0.0, 2, DType::F32);
        let dout = random(&[rows, cols], 1.0, 0.0, 3, DType::F32);
        let bias = random(&[cols], 0.5, 0.0, 4, DType::F32);
        for act in [Activation::Relu, Activation::Gelu] {
            let fwd = |d: &Device| {
                let b = bias.to_device(d).unwrap();
                ops::epilogue(&on(&y, d), Some(&b), Some(act), m, Some(&on(&r, d))).unwrap()
            };
            let bwd = |d: &Device| {
                let b = bias.to_device(d).unwrap();
                ops::epilogue_backward(&on(&dout, d), &on(&y, d), Some(&b), Some(act), m).unwrap()
            };
            let op = format!("epilogue-{act:?}").to_lowercase();
            check(
                &op,
                dtype,
                &shape,
                "y",
                &fwd(&dev),
                &fwd(&Device::Cpu),
                tol(dtype),
            );
            check(
                &op,
                dtype,
                &shape,
                "dy",
                &bwd(&dev),
                &bwd(&Device::Cpu),
                tol(dtype),
            );
        }
        let (vocab, b, s) = (50, 4, 25);
        let ids: Vec<u32> = (0..(b * s) as u32).map(|i| (i * 13 + 5) % vocab).collect();
        let ids = Tensor::from_vec(ids, (b, s), &Device::Cpu).unwrap();
        let table = random(&[vocab as usize, cols], 1.0, 0.0, 5, DType::F32);
        let pos = random(&[s, cols], 1.0, 0.0, 6, DType::F32);
        let emb = |d: &Device| {
            let ids = ids.to_device(d).unwrap();
            ops::embed(&ids, &on(&table, d), Some(&on(&pos, d)), s, m).unwrap()
        };
        let shape = format!("[{vocab},{cols}]");
        check(
            "embed",
            dtype,
            &shape,
            "y",
            &emb(&dev),
            &emb(&Device::Cpu),
            tol(dtype),
        );
        let d_emb = random(&[b * s, cols], 1.0, 0.0, 7, DType::F32);
        let emb_grad = |d: &Device| {
            let ids = ids.to_device(d).unwrap();
            ops::embed_backward(&ids, &on(&d_emb, d), vocab as usize).unwrap()
        };
        check(
            "embed",
            dtype,
            &shape,
            "dtable",
            &emb_grad(&dev),
            &emb_grad(&Device::Cpu),
            tol(DType::F32),
        );
        // Into a tied head's gradient, in place.
        let head = random(&[vocab as usize, cols], 1.0, 0.0, 10, DType::F32);
        let emb_grad_into = |d: &Device| {
            let ids = ids.to_device(d).unwrap();
            let sum = head.to_device(d).unwrap().copy().unwrap();
            ops::embed_backward_into(&ids, &on(&d_emb, d), &sum).unwrap();
            sum
        };
        check(
            "embed",
            dtype,
            &shape,
            "dtable into",
            &emb_grad_into(&dev),
            &emb_grad_into(&Device::Cpu),
            tol(DType::F32),
        );
        // One slice of the table's rows (ids outside it skipped), as the head by rows does.
        let emb_grad_rows = |d: &Device| {
            let ids = ids.to_device(d).unwrap();
            let sum = head
                .narrow(0, 20, 17)
                .unwrap()
                .to_device(d)
                .unwrap()
                .copy()
                .unwrap();
            ops::embed_backward_rows_into(&ids, &on(&d_emb, d), &sum, 20).unwrap();
            sum
        };
        check(
            "embed",
            dtype,
            &shape,
            "dtable rows",
            &emb_grad_rows(&dev),
            &emb_grad_rows(&Device::Cpu),
            tol(DType::F32),
        );
        // The cross-entropy gradient of a slice of columns from each row's log-sum-exp, past
        // the classes (padding) included.
        let (ce_rows, ce_cols, classes) = (70, 200, 190);
        let logits = random(&[ce_rows, ce_cols], 3.0, 0.0, 11, DType::F32);
        let targets: Vec<u32> = (0..ce_rows as u32).map(|i| (i * 37 + 3) % 190).collect();
        let targets = Tensor::from_vec(targets, ce_rows, &Device::Cpu).unwrap();
        let row_grad = random(&[ce_rows], 1.0, 0.0, 12, DType::F32);
        let ce_cols_grad = |d: &Device| {
            let (l, t, g) = (
                on(&logits, d),
                targets.to_device(d).unwrap(),
                row_grad.to_device(d).unwrap(),
            );
            let losses = ops::cross_entropy_rows_padded(&l, &t, classes).unwrap();
            let lse = ops::cross_entropy_lse(&l, &t, &losses).unwrap();
            let part = l.narrow(1, 128, 72).unwrap();
            ops::cross_entropy_backward_columns(&part, &t, 128, classes, &lse, &g).unwrap()
        };
        check(
            "cross-entropy",
            dtype,
            "[70,128..200]",
            "dlogits columns",
            &ce_cols_grad(&dev),
            &ce_cols_grad(&Device::Cpu),
            tol(dtype),
        );
        let x = random(&[3, 2, 40, 40], 2.0, 0.0, 8, DType::F32);
        let dy = random(&[3, 2, 40, 40], 1.0, 0.0, 9, DType::F32);
        let sm = |d: &Device| {
            let p = ops::attention_softmax(&on(&x, d), 0.3, 40).unwrap();
            let dx = ops::attention_softmax_backward(&p, &on(&dy, d), 0.3).unwrap();
            (p, dx)
        };
        let ((p_g, dx_g), (p_c, dx_c)) = (sm(&dev), sm(&Device::Cpu));
        check(
            "causal-softmax",
            dtype,
            "[3,2,40,40]",
            "y",
            &p_g,
            &p_c,
            tol(dtype),
        );
        check(
            "causal-softmax",
            dtype,
            "[3,2,40,40]",
            "dx",
            &dx_g,
            &dx_c,
            tol(dtype),
        );
        // Head split and merge: 16-byte units (head_dim 64) and single elements (head_dim 5).
        for (shape, perm) in [
            (vec![2, 7, 3, 4, 64], vec![2, 0, 3, 1, 4]),
            (vec![3, 2, 4, 7, 64], vec![1, 3, 0, 2, 4]),
            (vec![2, 4, 7, 64], vec![0, 2, 1, 3]),
            (vec![2, 7, 3, 4, 5], vec![2, 0, 3, 1, 4]),
        ] {
            let x = random(&shape, 1.0, 0.0, 10, DType::F32);
            let p = |d: &Device| ops::permute_contiguous(&on(&x, d), &perm).unwrap();
            let name = format!("{shape:?}");
            check(
                "permute",
                dtype,
                &name,
                "y",
                &p(&dev),
                &p(&Device::Cpu),
                0.0,
            );
        }
    }
}

/// The streamed offload on the GPU trains what the on-device optimizer trains: the same losses
/// to bf16 rounding, and device working copies that are their host masters' casts bit for bit,
/// so every part went down and came back up whole and in place.
#[test]
fn cuda_streamed_offload_tracks_the_device_optimizer() {
    use autotune::knobs::Offload;
    let spec = small_gpt();
    let dev = gpu();
    let data = Data::open(&DataSpec::Pattern, &spec).unwrap();
    let train = |offload| {
        let knobs = Knobs {
            offload,
            ..Knobs::new(4, Precision::Bf16)
        };
        let mut t = Trainer::new(&spec, knobs, &dev, 3).unwrap();
        let losses: Vec<f64> = (0..6).map(|_| t.step(&data).unwrap().loss).collect();
        (t, losses)
    };
    let (_, on_device) = train(Offload::None);
    let (host, offloaded) = train(Offload::Optimizer);
    eprintln!("losses on device {on_device:?}, offloaded {offloaded:?}");
    for (a, b) in on_device.iter().zip(&offloaded) {
        assert!((a - b).abs() <= 2e-2 * a.abs(), "{a} vs {b}");
    }
    assert!(offloaded[5] < offloaded[0], "{offloaded:?}");
    let masters = host.master_weights().unwrap();
    for (w, m) in host.model().params().vars().iter().zip(&masters) {
        let cast = m.to_dtype(w.dtype()).unwrap().to_dtype(DType::F32).unwrap();
        let working = w
            .to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        };
        assert!(
            bits(&cast) == bits(&working),
            "a working copy is not its master's cast"
        );
    }
}

/// An id at or past the vocabulary reads as NaN on the GPU and adds nothing to the table's
/// gradient, where an unchecked index would read and atomically add out of bounds.
#[test]
fn cuda_embedding_ids_past_the_vocabulary_touch_no_memory() {
    let dev = gpu();
    let (vocab, d) = (8u32, 16);
    let ids = Tensor::from_vec(vec![1u32, vocab, 3, u32::MAX], (1, 4), &dev).unwrap();
    let table = Tensor::ones((vocab as usize, d), DType::F32, &dev).unwrap();
    let out = ops::embed(&ids, &table, None, 4, None).unwrap();
    let rows: Vec<Vec<f32>> = out.reshape((4, d)).unwrap().to_vec2().unwrap();
    assert!(rows[0].iter().all(|x| *x == 1.0) && rows[2].iter().all(|x| *x == 1.0));
    assert!(
        rows[1].iter().chain(&rows[3]).all(|x| x.is_nan()),
        "{rows:?}"
    );
    let d_out = Tensor::ones((4, d), DType::F32, &dev).unwrap();
    let grad = ops::embed_backward(&ids, &d_out, vocab as usize).unwrap();
    let total: f32 = grad.sum_all().unwrap().to_scalar().unwrap();
    assert_eq!(
        total,
        2.0 * d as f32,
        "only the two valid ids add their rows"
    );
}

/// Delayed scaling on the GPU converts as on the host, to the bit: the same scales from the
/// same history over a sequence with a spike (each way in: rows, a pair, transposed), the
/// same largest magnitudes recorded by the conversions themselves (a NaN ignored).
#[test]
fn cuda_fp8_delayed_scaling_matches_the_host() {
    use autotune::ops::fp8::{self, Fp8Format, OperandLayout, ScaleHistory};
    let dev = gpu();
    for (rows, cols) in [(67, 96), (128, 96), (5, 7)] {
        for dtype in [DType::F32, DType::BF16] {
            for format in [Fp8Format::E4m3, Fp8Format::E5m2] {
                let what = format!("{rows}x{cols} {dtype:?} {format:?}");
                let (host_history, device_history) =
                    (ScaleHistory::new(format, 2), ScaleHistory::new(format, 2));
                for (step, size) in [1.0, 8.0, 1.0, 1.0, 0.5].into_iter().enumerate() {
                    let mut values: Vec<f32> =
                        random(&[rows, cols], size, 0.0, 20 + step as u64, DType::F32)
                            .flatten_all()
                            .unwrap()
                            .to_vec1()
                            .unwrap();
                    values[3] = f32::NAN;
                    let host = Tensor::from_vec(values, (rows, cols), &Device::Cpu)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap();
                    let device = host.to_device(&dev).unwrap();
                    let convert = |history: &ScaleHistory, t: &Tensor| match step % 3 {
                        0 => vec![history.quantize(t, OperandLayout::Rows).unwrap()],
                        1 => {
                            let (a, b) = history.quantize_pair(t).unwrap();
                            vec![a, b]
                        }
                        _ => vec![history.quantize(t, OperandLayout::Transposed).unwrap()],
                    };
                    let codes =
                        |o: &fp8::Fp8Operand| o.codes.flatten_all().unwrap().to_vec1::<u8>();
                    let inverse = |o: &fp8::Fp8Operand| o.scale_inv.to_vec1::<f32>().unwrap();
                    let (want, got) = (
                        convert(&host_history, &host),
                        convert(&device_history, &device),
                    );
                    for (want, got) in want.iter().zip(&got) {
                        assert_eq!(codes(got).unwrap(), codes(want).unwrap(), "{what} {step}");
                        assert_eq!(inverse(got), inverse(want), "{what} {step}");
                    }
                }
                assert_eq!(
                    device_history.magnitudes().unwrap(),
                    host_history.magnitudes().unwrap(),
                    "{what}"
                );
            }
        }
    }
    eprintln!("cuda-vs-cpu fp8 delayed scaling: codes, scales and magnitudes identical");
}

/// fp8 conversion on the GPU gives the host's codes and scale to the bit (f32 and bf16 inputs,
/// both formats, each layout alone and both from one pass; shapes that end inside a 32 × 32
/// or 64 × 64 tile, whose row count is or is not a multiple of 4 or 16, whose size is or is not
/// a multiple of 8;
/// values past the largest finite one and a NaN); on a GPU with fp8 tensor cores, cuBLASLt's
/// product of those codes equals the host's product of the same codes up to the tensor cores'
/// accumulation.
#[test]
fn cuda_fp8_conversion_and_products_match_the_host() {
    use autotune::ops::fp8::{self, Fp8Format, OperandLayout};
    let dev = gpu();
    for (rows, cols) in [(67, 96), (128, 96), (5, 7), (80, 136)] {
        let mut values: Vec<f32> = random(&[rows, cols], 2.0, 0.0, 11, DType::F32)
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        // A spike that sets the scale, values that land on subnormal codes, an exact zero, a
        // NaN.
        values[0] = 4.0e4;
        values[1] = -1.0e-3;
        values[2] = 0.0;
        values[3] = f32::NAN;
        let host = Tensor::from_vec(values, (rows, cols), &Device::Cpu).unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let host = host.to_dtype(dtype).unwrap();
            let device = host.to_device(&dev).unwrap();
            for format in [Fp8Format::E4m3, Fp8Format::E5m2] {
                let what = format!("{rows}x{cols} {dtype:?} {format:?}");
                let (pair_rows, pair_transposed) =
                    fp8::quantize_operand_pair(&device, format).unwrap();
                for (layout, from_pair) in [
                    (OperandLayout::Rows, pair_rows),
                    (OperandLayout::Transposed, pair_transposed),
                ] {
                    let want = fp8::quantize_operand(&host, format, layout).unwrap();
                    let got = fp8::quantize_operand(&device, format, layout).unwrap();
                    let codes =
                        |o: &fp8::Fp8Operand| o.codes.flatten_all().unwrap().to_vec1::<u8>();
                    let inverse = |o: &fp8::Fp8Operand| o.scale_inv.to_vec1::<f32>().unwrap();
                    for (got, how) in [(&got, "alone"), (&from_pair, "paired")] {
                        assert_eq!(
                            codes(got).unwrap(),
                            codes(&want).unwrap(),
                            "{what} {layout:?} {how}"
                        );
                        assert_eq!(inverse(got), inverse(&want), "{what} {layout:?} {how}");
                    }
                }
            }
        }
    }
    eprintln!("cuda-vs-cpu fp8 conversion: codes and scales identical");

    let a = random(&[48, 128], 1.0, 0.0, 12, DType::BF16);
    let b = random(&[80, 128], 1.0, 0.0, 13, DType::BF16);
    let operand =
        |t: &Tensor, format| fp8::quantize_operand(t, format, OperandLayout::Rows).unwrap();
    if !fp8::has_fp8_tensor_cores(&dev).unwrap() {
        let (qa, qb) = (
            operand(&a.to_device(&dev).unwrap(), Fp8Format::E4m3),
            operand(&b.to_device(&dev).unwrap(), Fp8Format::E4m3),
        );
        let err = fp8::fp8_product(&qa, &qb, DType::BF16)
            .unwrap_err()
            .to_string();
        assert!(err.contains("8.9"), "{err}");
        eprintln!("cuda fp8 products: no fp8 tensor cores here, refused: {err}");
        return;
    }
    for (fa, fb) in [
        (Fp8Format::E4m3, Fp8Format::E4m3),
        (Fp8Format::E5m2, Fp8Format::E4m3),
    ] {
        let want = fp8::fp8_product(&operand(&a, fa), &operand(&b, fb), DType::F32).unwrap();
        let (qa, qb) = (
            operand(&a.to_device(&dev).unwrap(), fa),
            operand(&b.to_device(&dev).unwrap(), fb),
        );
        // fp8 tensor cores add their products in a narrower accumulator than f32 before
        // cuBLASLt promotes the sums (about 14 bits on Hopper; measured 2.9e-4 here), so even
        // an f32 output differs from the host's f32 sum by more than summation order.
        for (dtype, tolerance) in [(DType::F32, 1e-3), (DType::BF16, 1e-2)] {
            let got = fp8::fp8_product(&qa, &qb, dtype)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let what = format!("{fa:?}x{fb:?}");
            check(
                "fp8 product",
                dtype,
                "48x128x80",
                &what,
                &got,
                &want,
                tolerance,
            );
        }
        // `b` as the second half of a pair converted from bᵀ: codes that start inside their
        // buffer, as a gradient's do.
        let bt = b
            .t()
            .unwrap()
            .contiguous()
            .unwrap()
            .to_device(&dev)
            .unwrap();
        let (_, b_from_pair) = fp8::quantize_operand_pair(&bt, fb).unwrap();
        let got = fp8::fp8_product(&qa, &b_from_pair, DType::F32).unwrap();
        let what = format!("{fa:?}x{fb:?} paired");
        check(
            "fp8 product",
            DType::F32,
            "48x128x80",
            &what,
            &got,
            &want,
            1e-3,
        );
    }
}

/// The fp8 product with its bias and residual in cuBLASLt's epilogue against the host's sum of
/// the same codes, bias and residual in f32: a bias, a bias and a residual, and a residual
/// alone, each of which must run fused on a GPU with fp8 tensor cores (a refusal names
/// cuBLASLt's answer).
#[test]
fn cuda_fp8_product_plus_matches_the_host() {
    use autotune::ops::fp8::{self, Fp8Format, OperandLayout};
    use autotune::ops::FusedLinear;
    let dev = gpu();
    if !fp8::has_fp8_tensor_cores(&dev).unwrap() {
        eprintln!("cuda fp8 product plus: no fp8 tensor cores here");
        return;
    }
    let (m, k, n) = (256, 768, 2304);
    let x = random(&[m, k], 1.0, 0.0, 21, DType::BF16);
    let w = random(&[n, k], 0.05, 0.0, 22, DType::BF16);
    let b = random(&[n], 0.5, 0.1, 23, DType::BF16);
    let r = random(&[m, n], 1.0, 0.0, 24, DType::BF16);
    let on_gpu = |t: &Tensor| t.to_device(&dev).unwrap();
    let operand = |t: &Tensor| fp8::quantize_operand(t, Fp8Format::E4m3, OperandLayout::Rows);
    let (qx, qw) = (operand(&x).unwrap(), operand(&w).unwrap());
    let (gx, gw) = (operand(&on_gpu(&x)).unwrap(), operand(&on_gpu(&w)).unwrap());
    for (what, bias, residual) in [
        ("bias", Some(&b), None),
        ("bias and residual", Some(&b), Some(&r)),
        ("residual", None, Some(&r)),
    ] {
        let want = fp8::fp8_product_plus(&qx, &qw, DType::F32, bias, residual)
            .unwrap()
            .computed()
            .unwrap();
        let (gb, gr) = (bias.map(on_gpu), residual.map(on_gpu));
        let got = match fp8::fp8_product_plus(&gx, &gw, DType::BF16, gb.as_ref(), gr.as_ref()) {
            Ok(FusedLinear::Computed(y)) => y.to_dtype(DType::F32).unwrap(),
            other => panic!("fp8 {what}: not fused: {other:?}"),
        };
        let shape = format!("{m}x{k}x{n}");
        check(
            "fp8 product plus",
            DType::BF16,
            &shape,
            what,
            &got,
            &want,
            1e-2,
        );
    }
}

/// The product with its bias and residual in cuBLASLt's epilogue against the same sum on the
/// CPU in f32 from the same half-precision values: with a bias (a q/k/v product), a bias and a
/// residual (GPT's output projections), and a residual alone (Llama's). Every case must run
/// fused: a refusal names cuBLASLt's answer.
#[test]
fn cuda_fused_linear_matches_the_separate_passes() {
    let dev = gpu();
    let (m, k, n) = (256, 768, 2304);
    for dtype in [DType::BF16, DType::F16] {
        let x = random(&[m, k], 1.0, 0.0, 1, dtype);
        let w = random(&[n, k], 0.05, 0.0, 2, dtype);
        let b = random(&[n], 0.5, 0.1, 3, dtype);
        let r = random(&[m, n], 1.0, 0.0, 4, dtype);
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let product = f32_of(&x).matmul(&f32_of(&w).t().unwrap()).unwrap();
        let on_gpu = |t: &Tensor| t.to_device(&dev).unwrap();
        for (what, bias, residual) in [
            ("bias", Some(&b), None),
            ("bias+res", Some(&b), Some(&r)),
            ("res", None, Some(&r)),
        ] {
            let mut expected = product.clone();
            if let Some(b) = bias {
                expected = expected.broadcast_add(&f32_of(b)).unwrap();
            }
            if let Some(r) = residual {
                expected = (expected + f32_of(r)).unwrap();
            }
            let outcome = ops::fused_linear(
                &on_gpu(&x),
                &on_gpu(&w),
                bias.map(on_gpu).as_ref(),
                residual.map(on_gpu).as_ref(),
            )
            .unwrap();
            let fused = match outcome {
                ops::FusedLinear::Computed(y) => y,
                other => panic!("{dtype:?} {what}: not fused on a GPU: {other:?}"),
            };
            assert_eq!(fused.dtype(), dtype);
            check(
                "fused-linear",
                dtype,
                "256x768x2304",
                what,
                &fused,
                &expected,
                tol(dtype),
            );
        }
    }
}

/// The norms' backward with a residual gradient added in the same pass, on the GPU against the
/// CPU, on rows a warp takes (768) and rows a block takes (1,001).
#[test]
fn cuda_norm_backward_plus_matches_the_cpu() {
    let dev = gpu();
    for dtype in DTYPES {
        for (rows, d) in [(300, 768), (37, 1001)] {
            let x = random(&[rows, d], 2.0, 0.3, 41, dtype);
            let dy = random(&[rows, d], 1.0, 0.0, 42, dtype);
            let plus = random(&[rows, d], 1.0, 0.0, 43, dtype);
            let gamma = random(&[d], 0.5, 1.0, 44, DType::F32);
            let run = |device: &Device| {
                let on = |t: &Tensor| t.to_device(device).unwrap();
                let (x, dy, plus, gamma) = (on(&x), on(&dy), on(&plus), on(&gamma));
                let ln = ops::layer_norm_backward_plus(&x, &gamma, &dy, Some(&plus), 1e-5)
                    .unwrap()
                    .0;
                let rms = ops::rms_norm_backward_plus(&x, &gamma, &dy, Some(&plus), 1e-5)
                    .unwrap()
                    .0;
                (ln, rms)
            };
            let (g, c) = (run(&dev), run(&Device::Cpu));
            let shape = format!("{rows}x{d}");
            let t = 2.0 * tol(dtype).max(1e-4);
            check("norm+plus", dtype, &shape, "ln dx", &g.0, &c.0, t);
            check("norm+plus", dtype, &shape, "rms dx", &g.1, &c.1, t);
        }
    }
}
