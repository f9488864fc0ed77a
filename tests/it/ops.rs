//! The fused ops (`autotune::ops`) against the composite code they replace, on the CPU.
//!
//! Errors are measured relative to the largest magnitude of the reference tensor
//! (`max |got − want| / max |want|`), so one tolerance fits tensors of any scale. Base
//! tolerances per dtype of the compared tensor ([`tol`]): f32 2e-5 (both sides compute in f32;
//! only summation order and `x·(1/s)` vs `x/s` differ), f16 2e-3 and bf16 1.6e-2 (one rounding
//! of the output to the dtype on each side, so at most one ulp apart: 2⁻¹⁰ and 2⁻⁷ relative,
//! with a factor 2 of headroom). Per-op adjustments are explained where they are made:
//! cross-entropy gradients add `2⁻²³·max|logit|`, softmax `dx` is measured against `max|dy|`,
//! layer norm uses at least 1e-4 and twice that for `dx`, whole-model f32 gradients 1e-5.

use candle_core::{DType, Device, Tensor, Var, D};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use autotune::data::source::{Data, DataSpec};
use autotune::knobs::{Knobs, Precision};
use autotune::model::layers::{self, Norm};
use autotune::model::params::ParamStore;
use autotune::model::Engine;
use autotune::ops;
use autotune::spec::model::NormKind;
use autotune::train::step::Trainer;

use crate::util::{small_gpt, small_seed};

pub const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Tolerance on the max-relative error of a tensor of `dtype` (see the module doc).
pub fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 2e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        other => panic!("no tolerance for {other:?}"),
    }
}

/// `n` standard-normal f32 values from a seeded generator.
pub fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let u1 = 1.0 - rng.random::<f64>();
            let u2 = rng.random::<f64>();
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}

/// A CPU tensor of `shape`: `offset + scale · N(0, 1)`, cast to `dtype`.
pub fn random(shape: &[usize], scale: f32, offset: f32, seed: u64, dtype: DType) -> Tensor {
    let n = shape.iter().product();
    let values = randn(n, seed)
        .into_iter()
        .map(|v| offset + scale * v)
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// `rows` class indices below `classes`.
pub fn targets(rows: usize, classes: usize, seed: u64) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let t: Vec<u32> = (0..rows)
        .map(|_| rng.random_range(0..classes as u32))
        .collect();
    Tensor::from_vec(t, rows, &Device::Cpu).unwrap()
}

fn to_vec(t: &Tensor) -> Vec<f64> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `(max |got − want|, that divided by max |want|)`; NaN anywhere makes both NaN.
pub fn errors(got: &Tensor, want: &Tensor) -> (f64, f64) {
    assert_eq!(got.dims(), want.dims(), "shapes differ");
    let (g, w) = (to_vec(got), to_vec(want));
    let mut abs = 0f64;
    let mut scale = 0f64;
    for (a, b) in g.iter().zip(&w) {
        let d = (a - b).abs();
        abs = if d.is_nan() { f64::NAN } else { abs.max(d) };
        scale = scale.max(b.abs());
    }
    (abs, abs / scale.max(1e-30))
}

/// Asserts `got ≈ want` within `tol` (max-relative) and returns the errors.
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> (f64, f64) {
    let (abs, rel) = errors(got, want);
    assert!(
        rel <= tol,
        "{what}: max abs error {abs:e}, relative {rel:e} > tolerance {tol:e}"
    );
    (abs, rel)
}

/// A trainable leaf holding `t`.
fn leaf(t: &Tensor) -> Var {
    Var::from_tensor(t).unwrap()
}

#[test]
fn cross_entropy_matches_composite_and_f64() {
    // (rows, classes, logit scale, logit offset)
    let cases = [
        (1, 2, 1.0, 0.0),
        (7, 97, 1.0, 0.0),
        (33, 1000, 3.0, 0.0),
        (300, 10, 1.0, 0.0),
        (5, 10_000, 2.0, 0.0),
        (9, 257, 30.0, 500.0), // large magnitude: exp overflows without the max shift
        (4, 64, 100.0, -300.0),
    ];
    for (i, &(rows, classes, scale, offset)) in cases.iter().enumerate() {
        for dtype in DTYPES {
            let what = format!("cross-entropy {rows}x{classes} ×{scale}+{offset} {dtype:?}");
            let seed = 100 + i as u64;
            let logits = random(&[rows, classes], scale, offset, seed, dtype);
            let t = targets(rows, classes, seed);

            let fused_var = leaf(&logits);
            let fused = ops::cross_entropy(fused_var.as_tensor(), &t).unwrap();
            let comp_var = leaf(&logits);
            let comp =
                layers::cross_entropy(comp_var.as_tensor(), &t, None, Engine::Composite).unwrap();
            assert_eq!(fused.dtype(), DType::F32);
            assert_eq!(fused.rank(), 0);
            assert_close(&format!("{what} loss"), &fused, &comp, 2e-5);
            assert_close(
                &format!("{what} loss vs f64"),
                &fused,
                &ce_f64(&logits, &t),
                1e-5,
            );

            // Scale the loss so the upstream gradient is not 1/rows.
            let g_fused = (fused * 3.5).unwrap().backward().unwrap();
            let g_comp = (comp * 3.5).unwrap().backward().unwrap();
            let g_fused = g_fused.get(&fused_var).unwrap();
            assert_eq!(g_fused.dtype(), dtype);
            assert_close(
                &format!("{what} grad"),
                g_fused,
                g_comp.get(&comp_var).unwrap(),
                ce_grad_tol(dtype, &logits),
            );
        }
    }
}

/// Backward rebuilds each row's log-sum-exp as `loss + logit[target]` in f32, which is off
/// by up to about one ulp of |lse|; exp turns that into a relative error of the probabilities,
/// so large-magnitude logits get `2⁻²³ · max |logit|` on top of the dtype's tolerance.
pub fn ce_grad_tol(dtype: DType, logits: &Tensor) -> f64 {
    let max_logit = to_vec(logits).iter().fold(0f64, |m, v| m.max(v.abs()));
    tol(dtype) + max_logit * 2f64.powi(-23)
}

/// Mean loss in f64 from the (already rounded) logits.
fn ce_f64(logits: &Tensor, targets: &Tensor) -> Tensor {
    let (rows, classes) = logits.dims2().unwrap();
    let x = to_vec(logits);
    let t: Vec<u32> = targets.to_vec1().unwrap();
    let total: f64 = x
        .chunks(classes)
        .zip(&t)
        .map(|(row, &t)| {
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
            lse - row[t as usize]
        })
        .sum();
    Tensor::new((total / rows as f64) as f32, &Device::Cpu).unwrap()
}

#[test]
fn per_row_cross_entropy_takes_per_row_upstream_gradients_and_any_layout() {
    let (rows, classes) = (13, 50);
    for dtype in DTYPES {
        // Transposed storage: the op must make its own contiguous copy.
        let logits = random(&[classes, rows], 2.0, 0.0, 7, dtype).t().unwrap();
        assert!(!logits.is_contiguous());
        let t = targets(rows, classes, 7);
        let w = random(&[rows], 1.0, 0.0, 8, DType::F32);

        let var = leaf(&logits);
        let loss = ops::cross_entropy_rows(var.as_tensor(), &t).unwrap();
        let grads = (&loss * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let got = grads.get(&var).unwrap();

        // Reference: (softmax − onehot) · w per row, in f64.
        let x = to_vec(&logits);
        let tv: Vec<u32> = t.to_vec1().unwrap();
        let wv = to_vec(&w);
        let mut want = Vec::with_capacity(rows * classes);
        let mut want_loss = Vec::with_capacity(rows);
        for (r, row) in x.chunks(classes).enumerate() {
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = row.iter().map(|v| (v - max).exp()).sum();
            want_loss.push((sum.ln() + max - row[tv[r] as usize]) as f32);
            for (j, v) in row.iter().enumerate() {
                let onehot = if j == tv[r] as usize { 1.0 } else { 0.0 };
                want.push(((v - max).exp() / sum - onehot) * wv[r]);
            }
        }
        let want = Tensor::from_vec(want, (rows, classes), &Device::Cpu).unwrap();
        let want_loss = Tensor::from_vec(want_loss, rows, &Device::Cpu).unwrap();
        assert_close(&format!("{dtype:?} per-row loss"), &loss, &want_loss, 1e-5);
        assert_close(&format!("{dtype:?} per-row grad"), got, &want, tol(dtype));
    }
}

#[test]
fn padded_cross_entropy_ignores_the_padding_columns() {
    // 37 classes in rows of 64 columns; the padding holds large values that would dominate
    // the log-sum-exp if they took part.
    let (rows, classes, cols) = (9, 37, 64);
    for dtype in DTYPES {
        let logits = random(&[rows, classes], 2.0, 0.0, 11, dtype);
        let padding = random(&[rows, cols - classes], 1.0, 30.0, 12, dtype);
        let padded = Tensor::cat(&[&logits, &padding], 1).unwrap();
        let t = targets(rows, classes, 13);
        let row_grad = random(&[rows], 1.0, 0.0, 14, DType::F32);

        let want_loss = ops::cross_entropy_rows(&logits, &t).unwrap();
        let loss = ops::cross_entropy_rows_padded(&padded, &t, classes).unwrap();
        assert_close(&format!("{dtype:?} padded loss"), &loss, &want_loss, 0.0);

        let want =
            ops::cross_entropy_backward(&logits, &t, classes, &want_loss, &row_grad).unwrap();
        let got = ops::cross_entropy_backward(&padded, &t, classes, &loss, &row_grad).unwrap();
        assert_eq!(got.dims(), &[rows, cols]);
        assert_close(
            &format!("{dtype:?} padded grad"),
            &got.narrow(1, 0, classes).unwrap(),
            &want,
            0.0,
        );
        let pad_grad = to_vec(&got.narrow(1, classes, cols - classes).unwrap());
        assert!(
            pad_grad.iter().all(|&g| g == 0.0),
            "{dtype:?}: padding got a gradient"
        );

        // The graph's backward agrees with the explicit one.
        let var = leaf(&padded);
        let loss = ops::cross_entropy_rows_padded(var.as_tensor(), &t, classes).unwrap();
        let grads = (&loss * &row_grad)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert_close(
            &format!("{dtype:?} graph grad"),
            grads.get(&var).unwrap(),
            &got,
            0.0,
        );
    }
    let logits = random(&[3, 8], 1.0, 0.0, 1, DType::F32);
    let t = Tensor::new(&[0u32, 5, 1], &Device::Cpu).unwrap();
    assert!(
        ops::cross_entropy_rows_padded(&logits, &t, 5).is_err(),
        "target 5 of 5 classes"
    );
    assert!(
        ops::cross_entropy_rows_padded(&logits, &t, 9).is_err(),
        "9 classes in 8 columns"
    );
    assert!(
        ops::cross_entropy_rows_padded(&logits, &t, 0).is_err(),
        "no classes"
    );
}

#[test]
fn cross_entropy_rejects_bad_targets() {
    let logits = random(&[3, 5], 1.0, 0.0, 1, DType::F32);
    let out_of_range = Tensor::new(&[0u32, 5, 1], &Device::Cpu).unwrap();
    assert!(ops::cross_entropy(&logits, &out_of_range).is_err());
    let too_few = Tensor::new(&[0u32, 1], &Device::Cpu).unwrap();
    assert!(ops::cross_entropy(&logits, &too_few).is_err());
}

#[test]
fn softmax_matches_composite() {
    // (shape, scale, causal mask on the last two dims)
    let cases: [(&[usize], f32, bool); 7] = [
        (&[1, 1], 1.0, false),
        (&[3, 7], 1.0, false),
        (&[2, 3, 130], 2.0, false),
        (&[4, 1025], 1.0, false),
        (&[2, 4, 33, 33], 1.0, true),
        (&[5, 64], 40.0, false), // large magnitude
        (&[2, 2, 17, 17], 20.0, true),
    ];
    for (i, &(shape, scale, causal)) in cases.iter().enumerate() {
        for dtype in DTYPES {
            let what = format!("softmax {shape:?} ×{scale} causal={causal} {dtype:?}");
            let mut x = random(shape, scale, 0.0, 200 + i as u64, dtype);
            if causal {
                x = x
                    .broadcast_add(&causal_mask(shape[shape.len() - 1], dtype))
                    .unwrap();
            }
            let w = random(shape, 1.0, 0.0, 300 + i as u64, DType::F32);
            let (y_f, dx_f) = softmax_and_grad(&x, &w, Engine::Fused);
            let (y_c, dx_c) = softmax_and_grad(&x, &w, Engine::Composite);
            assert_eq!(y_f.dtype(), dtype);
            assert_eq!(dx_f.dtype(), dtype);
            assert_close(&format!("{what} y"), &y_f, &y_c, tol(dtype));
            // Backward uses the output rounded to the dtype (nothing else is saved), and
            // dy − Σ dy·y cancels for peaked rows, so dx is bounded in absolute terms:
            // |dx| ≤ 2·max|dy|, and its error by tol · max|dy|.
            let (abs, _) = errors(&dx_f, &dx_c);
            let bound = tol(dtype) * to_vec(&w).iter().fold(0f64, |m, v| m.max(v.abs()));
            assert!(abs <= bound, "{what} dx: max abs error {abs:e} > {bound:e}");
        }
    }
}

/// Additive causal mask (0 on and below the diagonal, −∞ above) of `s × s`.
pub fn causal_mask(s: usize, dtype: DType) -> Tensor {
    let v: Vec<f32> = (0..s * s)
        .map(|k| {
            if k % s > k / s {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(v, (s, s), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// Softmax of `x` and its gradient under the loss `Σ softmax(x) · w`.
///
/// The composite reference runs on an f32 copy of `x` and casts the result back, as the
/// composite layer norm and loss do: the fused op computes in f32 too, while the composite
/// softmax on bf16/f16 input would do max, exp, sum and divide in that dtype (errors of tens
/// of percent on long rows), which is no reference.
fn softmax_and_grad(x: &Tensor, w: &Tensor, engine: Engine) -> (Tensor, Tensor) {
    let var = leaf(x);
    let y = match engine {
        Engine::Fused | Engine::Explicit | Engine::ExplicitMaterialized => {
            layers::softmax_last_dim(var.as_tensor(), engine).unwrap()
        }
        Engine::Composite => {
            let xf = var.as_tensor().to_dtype(DType::F32).unwrap();
            layers::softmax_last_dim(&xf, engine)
                .unwrap()
                .to_dtype(x.dtype())
                .unwrap()
        }
    };
    let loss = (y.to_dtype(DType::F32).unwrap() * w)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    (y, grads.get(&var).unwrap().clone())
}

#[test]
fn softmax_accepts_non_contiguous_input() {
    let x = random(&[6, 9], 1.0, 0.0, 11, DType::F32).t().unwrap();
    let got = ops::softmax_last_dim(&x).unwrap();
    let want = layers::softmax_last_dim(&x, Engine::Composite).unwrap();
    assert_close("transposed softmax", &got, &want, tol(DType::F32));
}

#[test]
fn layer_norm_matches_composite() {
    // (shape, scale, offset): the offset checks that a large mean does not cancel the variance.
    let cases: [(&[usize], f32, f32); 6] = [
        (&[1, 8], 1.0, 0.0),
        (&[3, 5, 32], 1.0, 0.0),
        (&[37, 768], 2.0, 0.5),
        (&[2, 1000], 1.0, 0.0),
        (&[300, 16], 1.0, 0.0), // many rows: the parameter reduction sums over them
        (&[11, 64], 0.1, 20.0),
    ];
    for (i, &(shape, scale, offset)) in cases.iter().enumerate() {
        for dtype in DTYPES {
            let what = format!("layer norm {shape:?} ×{scale}+{offset} {dtype:?}");
            let seed = 400 + i as u64;
            let d = shape[shape.len() - 1];
            let x = random(shape, scale, offset, seed, dtype);
            let w = random(shape, 1.0, 0.0, seed + 50, DType::F32);
            let fused = layer_norm_and_grads(&x, &w, seed, Engine::Fused);
            let comp = layer_norm_and_grads(&x, &w, seed, Engine::Composite);
            assert_eq!(fused[0].dtype(), dtype);
            assert_eq!(fused[1].dtype(), dtype);
            assert_eq!(fused[2].dims(), [d]);
            // f32 gets 1e-4: with |mean| ≫ std the rounding of the mean (an f32 sum in the
            // composite, f64 here) is magnified by mean/std in the normalised output.
            let t = tol(dtype).max(1e-4);
            assert_close(&format!("{what} y"), &fused[0], &comp[0], t);
            assert_close(&format!("{what} dx"), &fused[1], &comp[1], 2.0 * t);
            assert_close(&format!("{what} dgamma"), &fused[2], &comp[2], t);
            assert_close(&format!("{what} dbeta"), &fused[3], &comp[3], t);
        }
    }
}

/// `[y, dx, dgamma, dbeta]` for the loss `Σ layer_norm(x) · w`, with random gamma and beta.
fn layer_norm_and_grads(x: &Tensor, w: &Tensor, seed: u64, engine: Engine) -> Vec<Tensor> {
    let d = x.dim(D::Minus1).unwrap();
    let mut store = ParamStore::new(&Device::Cpu, seed);
    let norm = Norm::new(&mut store, "norm", d, 1e-5, NormKind::Layer).unwrap();
    let (gamma, beta) = (&store.vars()[0], &store.vars()[1]);
    gamma
        .set(&random(&[d], 0.5, 1.0, seed + 1, DType::F32))
        .unwrap();
    beta.set(&random(&[d], 0.5, 0.0, seed + 2, DType::F32))
        .unwrap();
    let var = leaf(x);
    let y = norm.forward(var.as_tensor(), engine).unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap() * w)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    vec![
        y,
        grads.get(&var).unwrap().clone(),
        grads.get(gamma).unwrap().clone(),
        grads.get(beta).unwrap().clone(),
    ]
}

#[test]
fn layer_norm_accepts_non_contiguous_input_and_rejects_bad_params() {
    let x = random(&[16, 5], 1.0, 0.0, 12, DType::F32).t().unwrap();
    let (g, b) = (
        random(&[16], 1.0, 1.0, 13, DType::F32),
        random(&[16], 1.0, 0.0, 14, DType::F32),
    );
    let got = ops::layer_norm(&x, &g, &b, 1e-5).unwrap();
    let xc = x.contiguous().unwrap();
    let want = ops::layer_norm(&xc, &g, &b, 1e-5).unwrap();
    assert_close("transposed layer norm", &got, &want, 0.0);
    let short = random(&[15], 1.0, 0.0, 15, DType::F32);
    assert!(ops::layer_norm(&x, &short, &b, 1e-5).is_err());
}

/// The norms' backward with a gradient added in the same pass gives the separate sum: exactly
/// in f32 (the same f32 values are added), and within one rounding in bf16, where the fused
/// pass rounds once and the separate add twice. Both norms, and a wrong shape refused.
#[test]
fn norm_backward_adds_a_residual_gradient_in_the_same_pass() {
    let (rows, d) = (12, 40);
    for (dtype, tolerance) in [(DType::F32, 0.0), (DType::BF16, tol(DType::BF16))] {
        let x = random(&[rows, d], 2.0, 0.3, 31, dtype);
        let dy = random(&[rows, d], 1.0, 0.0, 32, dtype);
        let plus = random(&[rows, d], 1.0, 0.0, 33, dtype);
        let gamma = random(&[d], 0.5, 1.0, 34, DType::F32);
        let to_f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let (dx, dg, db) = ops::layer_norm_backward(&x, &gamma, &dy, 1e-5).unwrap();
        let (fused, fdg, fdb) =
            ops::layer_norm_backward_plus(&x, &gamma, &dy, Some(&plus), 1e-5).unwrap();
        let separate = (to_f32(&dx) + to_f32(&plus)).unwrap();
        assert_close(
            "layer norm dx + plus",
            &to_f32(&fused),
            &separate,
            tolerance,
        );
        assert_close("layer norm dgamma", &fdg, &dg, 0.0);
        assert_close("layer norm dbeta", &fdb, &db, 0.0);
        let (dx, dg) = ops::rms_norm_backward(&x, &gamma, &dy, 1e-5).unwrap();
        let (fused, fdg) = ops::rms_norm_backward_plus(&x, &gamma, &dy, Some(&plus), 1e-5).unwrap();
        let separate = (to_f32(&dx) + to_f32(&plus)).unwrap();
        assert_close("rms norm dx + plus", &to_f32(&fused), &separate, tolerance);
        assert_close("rms norm dgamma", &fdg, &dg, 0.0);
    }
    let x = random(&[rows, d], 1.0, 0.0, 35, DType::F32);
    let gamma = random(&[d], 0.5, 1.0, 36, DType::F32);
    let short = random(&[rows, d - 1], 1.0, 0.0, 37, DType::F32);
    assert!(ops::rms_norm_backward_plus(&x, &gamma, &x, Some(&short), 1e-5).is_err());
}

#[test]
fn fused_and_composite_models_give_the_same_loss_and_gradients() {
    for spec in [small_seed(0.1), small_gpt()] {
        let data = Data::open(&DataSpec::Random, &spec).unwrap();
        let batch = data.batch(3, 0, 0, 4, &Device::Cpu).unwrap();
        let run = |engine, precision| {
            let mut trainer =
                Trainer::new(&spec, Knobs::new(4, precision), &Device::Cpu, 3).unwrap();
            trainer.set_engine(engine);
            trainer.gradients(std::slice::from_ref(&batch)).unwrap()
        };
        let names = Trainer::new(&spec, Knobs::new(4, Precision::Fp32), &Device::Cpu, 3)
            .unwrap()
            .model()
            .params()
            .names()
            .to_vec();
        let (g_ref, loss_ref) = run(Engine::Composite, Precision::Fp32);

        // f32: the two engines compute the same maths in the same precision.
        let (g_fused, loss_fused) = run(Engine::Fused, Precision::Fp32);
        let what = format!("{} fp32", spec.name);
        assert!(
            ((loss_fused - loss_ref) / loss_ref).abs() < 1e-6,
            "{what}: loss {loss_fused} (fused) vs {loss_ref} (composite)"
        );
        for ((name, a), b) in names.iter().zip(&g_fused).zip(&g_ref) {
            assert_nonzero_finite(&format!("{what} {name}"), a);
            assert_close(&format!("{what} {name} gradient"), a, b, 1e-5);
        }

        // bf16/f16: rounding differs between the engines (the composite softmax even runs in
        // the reduced dtype), so both are held to the f32 reference instead. Worst measured
        // per-parameter errors, equal for both engines within noise: bf16 0.25, f16 0.20
        // (small-seed, whose near-zero gradients magnify rounding; small-gpt 0.08 and 0.002).
        // The bounds leave 2× headroom.
        for (precision, loss_tol, grad_tol) in
            [(Precision::Bf16, 1e-3, 0.5), (Precision::Fp16, 1e-3, 0.4)]
        {
            let what = format!("{} {precision}", spec.name);
            for engine in [Engine::Fused, Engine::Composite] {
                let (grads, loss) = run(engine, precision);
                assert!(
                    ((loss - loss_ref) / loss_ref).abs() < loss_tol,
                    "{what} {engine:?}: loss {loss} vs f32 {loss_ref}"
                );
                for ((name, a), b) in names.iter().zip(&grads).zip(&g_ref) {
                    if engine == Engine::Fused {
                        assert_nonzero_finite(&format!("{what} {name}"), a);
                    }
                    let what = format!("{what} {engine:?} {name} gradient vs f32");
                    assert_close(&what, &a.to_dtype(DType::F32).unwrap(), b, grad_tol);
                }
            }
        }
    }
}

pub fn assert_nonzero_finite(what: &str, g: &Tensor) {
    let v = to_vec(g);
    assert!(
        v.iter().all(|x| x.is_finite()),
        "{what}: gradient is not finite"
    );
    assert!(v.iter().any(|x| *x != 0.0), "{what}: gradient is all zeros");
}
