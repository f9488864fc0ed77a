//! Flash attention's CUDA kernels against the CPU implementation (itself checked against an f64
//! reference in `attention.rs`), their run-to-run reproducibility, the engine with flash
//! attention against the materialised path on the GPU (timings are in `benches/cuda_timings.rs`).
//!
//! Needs a CUDA device (ordinal 0). Every comparison prints one line (`--nocapture` shows them)
//! and the test fails at the end, after all lines are out, if any comparison missed.
//!
//! Tolerances (max error relative to the CPU's largest magnitude): outputs `ops::tol`; gradients
//! twice that, because the kernels round the probabilities and their gradients to bf16/f16 as
//! the operands of the second product, where the CPU keeps them in f32.
//!
//! Every head width the kernels are built for is covered ([`ops::FLASH_HEAD_DIMS`]: 16 to 64
//! with 64-row tiles; 80, 96 and 128 with 32-row tiles, and at 128 a dk/dv kernel of two sweeps).
//! To tell a failing kernel from the line alone, the gradient of q/k/v is checked in its three
//! parts (dq from the dq kernel, dk and dv from the dk/dv kernel; each against the largest
//! magnitude of the whole gradient, so the criterion is the whole gradient's), and a miss names
//! how many elements are off and where the worst one is, as (sequence, token, head, column) for
//! outputs and gradients and (sequence, head, token) for log-sum-exps.

use candle_core::{DType, Device, Tensor};

use autotune::data::source::{Data, DataSpec};
use autotune::knobs::{Knobs, Precision};
use autotune::model::Engine;
use autotune::ops::{self, AttentionShape, DropoutMask};
use autotune::spec::model::ModelSpec;
use autotune::train::step::Trainer;

use crate::ops::{errors, random, tol};
use crate::util::small_gpt;

fn gpu() -> Device {
    Device::new_cuda(0).expect("these tests need a CUDA device")
}

/// Comparison lines that missed their tolerance.
#[derive(Default)]
struct Misses(Vec<String>);

impl Misses {
    fn check(&mut self, what: &str, got: &Tensor, want: &Tensor, tol: f64) {
        let (abs, rel) = errors(got, want);
        self.record(what, got, want, (abs, rel), tol, None);
    }

    /// [`Misses::check`] of a part of a tensor, its error relative to the largest magnitude of
    /// the whole (`scale`).
    fn check_part(&mut self, what: &str, got: &Tensor, want: &Tensor, scale: f64, tol: f64) {
        let (abs, _) = errors(got, want);
        self.record(
            what,
            got,
            want,
            (abs, abs / scale.max(1e-30)),
            tol,
            Some(scale),
        );
    }

    /// One line; on a miss also how many elements are off and the worst, against `tol` times
    /// `scale` (by default the largest magnitude of `want`).
    fn record(
        &mut self,
        what: &str,
        got: &Tensor,
        want: &Tensor,
        (abs, rel): (f64, f64),
        tol: f64,
        scale: Option<f64>,
    ) {
        // NaN misses: a comparison with NaN is false.
        let ok = rel <= tol;
        let mut line =
            format!("cuda {what:<72} max abs {abs:9.3e}  rel {rel:9.3e}  (tol {tol:.1e})");
        if !ok {
            let scale = scale.unwrap_or_else(|| max_abs(&values(want)));
            line += &format!("  MISS {}", where_off(got, want, tol * scale.max(1e-30)));
        }
        eprintln!("{line}");
        if !ok {
            self.0.push(line);
        }
    }

    fn finish(self) {
        assert!(self.0.is_empty(), "missed:\n{}", self.0.join("\n"));
    }
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_device(&Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .unwrap()
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0f64, |m, x| m.max(x.abs()))
}

/// How many elements of `got` are further than `limit` from `want` (NaN counts), and the worst
/// with its index (one per dimension).
fn where_off(got: &Tensor, want: &Tensor, limit: f64) -> String {
    let (g, w) = (values(got), values(want));
    let (mut off, mut worst, mut at) = (0usize, -1f64, 0usize);
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let d = (a - b).abs();
        let d = if d.is_nan() { f64::INFINITY } else { d };
        if d > limit {
            off += 1;
        }
        if d > worst {
            (worst, at) = (d, i);
        }
    }
    let mut index = vec![0; got.rank()];
    let mut rest = at;
    for (k, &n) in got.dims().iter().enumerate().rev() {
        index[k] = rest % n;
        rest /= n;
    }
    format!(
        "{off} of {} off, worst at {index:?}: {} for {}",
        g.len(),
        g[at],
        w[at]
    )
}

/// Rows `(batch·seq, heads·hd)` as `(batch, seq, heads, hd)`, so that a miss names the sequence,
/// token, head and column.
fn by_head(t: &Tensor, shape: &AttentionShape) -> Tensor {
    by_heads(t, shape, shape.heads)
}

fn by_heads(t: &Tensor, shape: &AttentionShape, heads: usize) -> Tensor {
    let hd = t.dim(1).unwrap() / heads;
    t.reshape((shape.batch, shape.seq, heads, hd)).unwrap()
}

/// Checks the output, log-sum-exp and the three parts of the q/k/v gradient of a GPU run
/// against the CPU's.
fn check_run(
    misses: &mut Misses,
    what: &str,
    shape: &AttentionShape,
    dtype: DType,
    (out, lse, dqkv): &(Tensor, Tensor, Tensor),
    (out_c, lse_c, dqkv_c): &(Tensor, Tensor, Tensor),
) {
    misses.check(
        &format!("{what} out"),
        &by_head(out, shape),
        &by_head(out_c, shape),
        tol(dtype),
    );
    misses.check(&format!("{what} lse"), lse, lse_c, tol(DType::F32) * 10.0);
    let d = out.dim(1).unwrap();
    let kvd = d / shape.heads * shape.kv_heads;
    let scale = max_abs(&values(dqkv_c));
    for (name, start, width, heads) in [
        ("dq", 0, d, shape.heads),
        ("dk", d, kvd, shape.kv_heads),
        ("dv", d + kvd, kvd, shape.kv_heads),
    ] {
        let cols = |t: &Tensor| by_heads(&t.narrow(1, start, width).unwrap(), shape, heads);
        misses.check_part(
            &format!("{what} {name}"),
            &cols(dqkv),
            &cols(dqkv_c),
            scale,
            2.0 * tol(dtype),
        );
    }
}

/// Fills and frees a large buffer with NaN, so that an output element a kernel fails to write
/// (allocated from the same pool) reads as NaN and fails its comparison.
fn poison_pool(dev: &Device) {
    drop(Tensor::full(f32::NAN, 64 << 20, dev).unwrap());
}

#[test]
fn cuda_flash_attention_matches_the_cpu() {
    let dev = gpu();
    let mut misses = Misses::default();
    let mask = DropoutMask { p: 0.1, key: 9 };
    let mut seed = 500;
    // Sequences of one token, of whole tiles (64, 128) and in between; at the wide heads also
    // of a 32-row tile and one more token (32, 33), and of several 64-row blocks (200, 300).
    // Then query heads sharing key/value heads at the decoders' widths: the dk/dv kernel runs
    // one block per key/value head and sums its group in registers, deterministically.
    for (batch, seq, heads, kv_heads, hd) in [
        (2, 200, 3, 3, 64),
        (3, 64, 2, 2, 32),
        (2, 129, 4, 4, 16),
        (1, 1, 2, 2, 64),
        (1, 300, 1, 1, 64),
        (2, 200, 3, 3, 128),
        (3, 64, 2, 2, 128),
        (1, 33, 2, 2, 128),
        (1, 1, 2, 2, 128),
        (1, 300, 1, 1, 128),
        (2, 129, 2, 2, 96),
        (1, 32, 3, 3, 96),
        (2, 100, 2, 2, 80),
        (1, 1, 1, 1, 80),
        (2, 200, 8, 2, 64),
        (1, 129, 14, 2, 64),
        (2, 100, 4, 1, 128),
        (1, 300, 6, 3, 128),
        (1, 33, 4, 2, 96),
        (1, 1, 4, 2, 64),
    ] {
        for causal in [false, true] {
            for dropout in [None, Some(mask)] {
                for dtype in [DType::BF16, DType::F16] {
                    seed += 2;
                    let shape = AttentionShape {
                        batch,
                        seq,
                        heads,
                        kv_heads,
                        causal,
                    };
                    let width = (heads + 2 * kv_heads) * hd;
                    let qkv = random(&[batch * seq, width], 1.0, 0.0, seed, dtype);
                    let dout = random(&[batch * seq, heads * hd], 1.0, 0.0, seed + 1, dtype);
                    let run = |device: &Device| {
                        let qkv = qkv.to_device(device).unwrap();
                        let dout = dout.to_device(device).unwrap();
                        let (out, lse) = ops::flash_attention(&qkv, &shape, dropout).unwrap();
                        let dqkv =
                            ops::flash_attention_backward(&qkv, &out, &lse, &dout, &shape, dropout)
                                .unwrap();
                        (out, lse, dqkv)
                    };
                    poison_pool(&dev);
                    let gpu = run(&dev);
                    let cpu = run(&Device::Cpu);
                    let what = format!(
                        "b{batch} s{seq} h{heads}/{kv_heads} hd{hd} causal={} drop={} {dtype:?}",
                        u8::from(causal),
                        u8::from(dropout.is_some())
                    );
                    check_run(&mut misses, &what, &shape, dtype, &gpu, &cpu);
                    // No atomics: a second run (on a freshly poisoned pool) is bit-identical.
                    poison_pool(&dev);
                    let (out2, lse2, dqkv2) = run(&dev);
                    let (out, lse, dqkv) = &gpu;
                    misses.check(&format!("{what} out rerun"), &out2, out, 0.0);
                    misses.check(&format!("{what} lse rerun"), &lse2, lse, 0.0);
                    misses.check(&format!("{what} dqkv rerun"), &dqkv2, dqkv, 0.0);
                }
            }
        }
    }
    misses.finish();
}

#[test]
fn cuda_padded_flash_attention_matches_the_cpu() {
    let dev = gpu();
    let mut misses = Misses::default();
    let mask = DropoutMask { p: 0.1, key: 11 };
    let mut seed = 700;
    // Lengths of one key, of whole tiles (64, 128), one past a tile (65) and the full sequence;
    // at the wide heads also of one and three 32-row tiles and one key more (32, 33, 97).
    for (batch, seq, heads, hd, lens) in [
        (4, 200, 2, 64, vec![200u32, 1, 64, 65]),
        (2, 129, 3, 32, vec![128, 129]),
        (2, 70, 2, 16, vec![7, 70]),
        (4, 150, 2, 128, vec![150, 1, 32, 97]),
        (2, 129, 1, 128, vec![33, 64]),
        (2, 100, 2, 96, vec![33, 100]),
        (2, 70, 2, 80, vec![65, 32]),
    ] {
        for causal in [false, true] {
            for dropout in [None, Some(mask)] {
                for dtype in [DType::BF16, DType::F16] {
                    seed += 2;
                    let shape = AttentionShape {
                        batch,
                        seq,
                        heads,
                        kv_heads: heads,
                        causal,
                    };
                    let d = heads * hd;
                    let qkv = random(&[batch * seq, 3 * d], 1.0, 0.0, seed, dtype);
                    let dout = random(&[batch * seq, d], 1.0, 0.0, seed + 1, dtype);
                    let lengths = Tensor::new(lens.as_slice(), &Device::Cpu).unwrap();
                    let run = |device: &Device| {
                        let qkv = qkv.to_device(device).unwrap();
                        let dout = dout.to_device(device).unwrap();
                        let lengths = lengths.to_device(device).unwrap();
                        let (out, lse) =
                            ops::flash_attention_padded(&qkv, &shape, dropout, &lengths).unwrap();
                        let dqkv = ops::flash_attention_padded_backward(
                            &qkv, &out, &lse, &dout, &shape, dropout, &lengths,
                        )
                        .unwrap();
                        (out, lse, dqkv)
                    };
                    poison_pool(&dev);
                    let gpu = run(&dev);
                    let cpu = run(&Device::Cpu);
                    let what = format!(
                        "b{batch} s{seq} h{heads} hd{hd} lens {lens:?} causal={} drop={} {dtype:?}",
                        u8::from(causal),
                        u8::from(dropout.is_some())
                    );
                    check_run(&mut misses, &what, &shape, dtype, &gpu, &cpu);
                    // Padding keys get exactly zero k and v gradients.
                    let dqkv = &gpu.2;
                    for (b, &len) in lens.iter().enumerate() {
                        let pad = seq - len as usize;
                        if pad > 0 {
                            let rows = dqkv.narrow(0, b * seq + len as usize, pad).unwrap();
                            let kv = rows.narrow(1, d, 2 * d).unwrap();
                            let zeros = kv.zeros_like().unwrap();
                            misses.check(
                                &format!("{what} padding dk dv of sequence {b}"),
                                &kv,
                                &zeros,
                                0.0,
                            );
                        }
                    }
                }
            }
        }
    }
    misses.finish();
}

/// Packed sequences on the GPU against the CPU (itself equal to each example alone, in
/// `attention.rs`): examples of one token, of whole and split tiles (64-row tiles; 32-row
/// streamed tiles at the wide heads), across block boundaries, grouped and not, with dropout.
#[test]
fn cuda_packed_flash_attention_matches_the_cpu() {
    let dev = gpu();
    let mut misses = Misses::default();
    let mask = DropoutMask { p: 0.1, key: 13 };
    let mut seed = 1700;
    for (seq, heads, kv_heads, hd, lengths) in [
        (200, 2, 2, 64, vec![vec![1, 63, 2, 64, 70], vec![200]]),
        (129, 4, 2, 32, vec![vec![65, 64], vec![1, 1, 127]]),
        (70, 2, 1, 16, vec![vec![7, 7, 56], vec![33, 37]]),
        (150, 2, 2, 128, vec![vec![31, 33, 86], vec![97, 53]]),
        (100, 4, 1, 96, vec![vec![32, 1, 67], vec![100]]),
        (70, 2, 2, 80, vec![vec![65, 5], vec![3, 30, 37]]),
    ] {
        for dropout in [None, Some(mask)] {
            for dtype in [DType::BF16, DType::F16] {
                seed += 2;
                let batch = lengths.len();
                let shape = AttentionShape {
                    batch,
                    seq,
                    heads,
                    kv_heads,
                    causal: true,
                };
                let (d, width) = (heads * hd, (heads + 2 * kv_heads) * hd);
                let qkv = random(&[batch * seq, width], 1.0, 0.0, seed, dtype);
                let dout = random(&[batch * seq, d], 1.0, 0.0, seed + 1, dtype);
                let ids = crate::attention::position_ids(&lengths);
                let ids = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
                let run = |device: &Device| {
                    let qkv = qkv.to_device(device).unwrap();
                    let dout = dout.to_device(device).unwrap();
                    let ids = ids.to_device(device).unwrap();
                    let (out, lse) =
                        ops::flash_attention_packed(&qkv, &shape, dropout, &ids).unwrap();
                    let dqkv = ops::flash_attention_packed_backward(
                        &qkv, &out, &lse, &dout, &shape, dropout, &ids,
                    )
                    .unwrap();
                    (out, lse, dqkv)
                };
                poison_pool(&dev);
                let gpu = run(&dev);
                let cpu = run(&Device::Cpu);
                let what = format!(
                    "s{seq} h{heads}/{kv_heads} hd{hd} {lengths:?} drop={} {dtype:?}",
                    u8::from(dropout.is_some())
                );
                check_run(&mut misses, &what, &shape, dtype, &gpu, &cpu);
            }
        }
    }
    misses.finish();
}

/// A GPT-shaped model whose heads the kernels support (d 128, 2 heads of 64), with dropout.
fn flash_gpt() -> ModelSpec {
    ModelSpec {
        name: "flash-gpt".into(),
        d_model: 128,
        n_heads: 2,
        d_ff: 256,
        seq_len: 96,
        dropout: 0.1,
        ..small_gpt()
    }
}

#[test]
fn cuda_flash_engine_matches_the_materialized_engine() {
    let dev = gpu();
    let mut misses = Misses::default();
    // Also with heads of 128 (d 256, 2 heads), the wide heads' kernels.
    let wide = ModelSpec {
        name: "flash-gpt-wide".into(),
        d_model: 256,
        d_ff: 512,
        ..flash_gpt()
    };
    for spec in [
        flash_gpt(),
        ModelSpec {
            causal: false,
            ..flash_gpt()
        },
        wide.clone(),
        ModelSpec {
            causal: false,
            ..wide
        },
    ] {
        // Otherwise both runs below would be materialised.
        for dtype in [DType::BF16, DType::F16] {
            assert!(
                ops::flash_attention_supported(&dev, dtype, spec.head_dim()),
                "no flash attention for heads of {}",
                spec.head_dim()
            );
        }
        let data = Data::open(&DataSpec::Random, &spec).unwrap();
        let batch = data.batch(3, 0, 0, 4, &dev).unwrap();
        for (precision, grad_tol) in [(Precision::Bf16, 0.5), (Precision::Fp16, 0.4)] {
            let run = |engine| {
                let mut trainer = Trainer::new(&spec, Knobs::new(4, precision), &dev, 3).unwrap();
                trainer.set_engine(engine);
                trainer.gradients(std::slice::from_ref(&batch)).unwrap()
            };
            let (g, loss) = run(Engine::Explicit);
            let (g_ref, loss_ref) = run(Engine::ExplicitMaterialized);
            let what = format!(
                "engine hd{} causal={} {precision}",
                spec.head_dim(),
                u8::from(spec.causal)
            );
            eprintln!("{what}: loss flash {loss:.6} materialized {loss_ref:.6}");
            if ((loss - loss_ref) / loss_ref).abs() > 1e-3 {
                misses.0.push(format!("{what}: loss {loss} vs {loss_ref}"));
            }
            let worst = g
                .iter()
                .zip(&g_ref)
                .map(|(a, b)| errors(a, b).1)
                .fold(0f64, f64::max);
            eprintln!("{what}: worst gradient rel error {worst:.3e} (tol {grad_tol})");
            if worst.is_nan() || worst > grad_tol {
                misses.0.push(format!("{what}: gradient error {worst:e}"));
            }
        }
    }
    misses.finish();
}

/// The one-launch Adam over many tensors against the per-tensor kernels, for Adam with L2
/// decay and AdamW: the same arithmetic, so bit-identical weights and moments.
#[test]
fn cuda_multi_tensor_adam_matches_per_tensor_adam() {
    use autotune::ops::host_optim::AdamConsts;
    use autotune::spec::model::OptimizerSpec;
    let dev = gpu();
    let mut misses = Misses::default();
    let sizes = [1usize, 7, 2048, 2049, 100_000, 3 * 4096 + 5];
    for spec in [
        OptimizerSpec {
            weight_decay: 0.01,
            ..OptimizerSpec::adam(1e-3)
        },
        OptimizerSpec::adamw(3e-4),
    ] {
        let fresh = |seed: u64, scale: f32| -> Vec<Tensor> {
            sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    random(&[n], scale, 0.0, seed + i as u64, DType::F32)
                        .abs()
                        .unwrap()
                        .to_device(&dev)
                        .unwrap()
                })
                .collect()
        };
        let copies =
            |ts: &[Tensor]| -> Vec<Tensor> { ts.iter().map(|t| t.copy().unwrap()).collect() };
        let (theta, m, v, g) = (
            fresh(1, 1.0),
            fresh(20, 0.1),
            fresh(40, 0.01),
            fresh(60, 1.0),
        );
        let (theta2, m2, v2) = (copies(&theta), copies(&m), copies(&v));
        for step in 1..=3 {
            let consts = AdamConsts::new(&spec, step);
            ops::adam_update_all(&theta, &m, &v, &g, &consts).unwrap();
            for i in 0..sizes.len() {
                ops::adam_update(&theta2[i], &m2[i], &v2[i], &g[i], &consts).unwrap();
            }
        }
        for i in 0..sizes.len() {
            let what = format!("adam {:?} n={}", spec.kind, sizes[i]);
            misses.check(&format!("{what} theta"), &theta[i], &theta2[i], 0.0);
            misses.check(&format!("{what} m"), &m[i], &m2[i], 0.0);
            misses.check(&format!("{what} v"), &v[i], &v2[i], 0.0);
        }
    }
    misses.finish();
}
