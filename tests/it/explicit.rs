//! The explicit engine (hand-written backward passes) against the composite reference on the
//! CPU: whole-model losses and every parameter's gradient, its epilogue, embedding and
//! attention-softmax ops against candle's autograd, and its dropout masks.
//!
//! Tolerances are the ops tests' (max error relative to the reference's largest magnitude):
//! f32 1e-5 for whole-model gradients (summation order differs), and in bf16/f16 the bounds the
//! fused engine is held to against f32.

use candle_core::{DType, Device, Tensor, Var};

use autotune::data::source::{Data, DataSpec};
use autotune::knobs::{Checkpointing, Knobs, Precision};
use autotune::model::batch::Batch;
use autotune::model::Engine;
use autotune::ops::{self, DropoutMask};
use autotune::spec::model::{Activation, ModelSpec};
use autotune::train::step::Trainer;

use crate::ops::{assert_close, assert_nonzero_finite, random, tol, DTYPES};
use crate::util::{small_gpt, small_llama, small_seed};

fn gradients(spec: &ModelSpec, knobs: Knobs, engine: Engine, batch: &Batch) -> (Vec<Tensor>, f64) {
    let mut trainer = Trainer::new(spec, knobs, &Device::Cpu, 3).unwrap();
    trainer.set_engine(engine);
    trainer.gradients(std::slice::from_ref(batch)).unwrap()
}

fn batch(spec: &ModelSpec) -> Batch {
    let data = Data::open(&DataSpec::Random, spec).unwrap();
    data.batch(3, 0, 0, 4, &Device::Cpu).unwrap()
}

fn names(spec: &ModelSpec) -> Vec<String> {
    Trainer::new(spec, Knobs::new(4, Precision::Fp32), &Device::Cpu, 3)
        .unwrap()
        .model()
        .params()
        .names()
        .to_vec()
}

#[test]
fn explicit_and_composite_models_give_the_same_loss_and_gradients() {
    // Without dropout: the engines draw different masks (hashed vs generator streams). The
    // decoders add RMS norm, SwiGLU, rotary positions, grouped key/value heads and a tied head.
    for spec in [
        small_seed(0.0),
        ModelSpec {
            dropout: 0.0,
            ..small_gpt()
        },
        small_llama(false),
        small_llama(true),
    ] {
        let batch = batch(&spec);
        let names = names(&spec);
        let fp32 = Knobs::new(4, Precision::Fp32);
        let (g_ref, loss_ref) = gradients(&spec, fp32, Engine::Composite, &batch);
        let (g, loss) = gradients(&spec, fp32, Engine::Explicit, &batch);
        let what = format!("{} fp32", spec.name);
        assert!(
            ((loss - loss_ref) / loss_ref).abs() < 1e-6,
            "{what}: loss {loss} (explicit) vs {loss_ref} (composite)"
        );
        assert_eq!(g.len(), g_ref.len());
        for ((name, a), b) in names.iter().zip(&g).zip(&g_ref) {
            assert_eq!(a.dtype(), b.dtype(), "{what} {name} dtype");
            assert_nonzero_finite(&format!("{what} {name}"), a);
            assert_close(&format!("{what} {name} gradient"), a, b, 1e-5);
        }
        // Reduced precision against the f32 reference, with the fused engine's bounds.
        for (precision, loss_tol, grad_tol) in
            [(Precision::Bf16, 1e-3, 0.5), (Precision::Fp16, 1e-3, 0.4)]
        {
            let (g, loss) = gradients(&spec, Knobs::new(4, precision), Engine::Explicit, &batch);
            let what = format!("{} {precision}", spec.name);
            assert!(
                ((loss - loss_ref) / loss_ref).abs() < loss_tol,
                "{what}: loss {loss} vs f32 {loss_ref}"
            );
            for ((name, a), b) in names.iter().zip(&g).zip(&g_ref) {
                assert_nonzero_finite(&format!("{what} {name}"), a);
                assert_close(&format!("{what} {name} vs f32"), a, b, grad_tol);
            }
        }
    }
}

#[test]
fn explicit_checkpointing_reproduces_the_plain_step_with_dropout() {
    for spec in [
        small_seed(0.1),
        ModelSpec {
            dropout: 0.1,
            ..small_gpt()
        },
        ModelSpec {
            dropout: 0.1,
            ..small_llama(true)
        },
    ] {
        let batch = batch(&spec);
        let plain = Knobs::new(4, Precision::Fp32);
        let (g_plain, loss_plain) = gradients(&spec, plain, Engine::Explicit, &batch);
        for checkpointing in [Checkpointing::EveryKth(1), Checkpointing::EveryKth(2)] {
            let knobs = Knobs {
                checkpointing,
                ..plain
            };
            let (g, loss) = gradients(&spec, knobs, Engine::Explicit, &batch);
            assert_eq!(loss, loss_plain, "{} {checkpointing:?} loss", spec.name);
            for (a, b) in g.iter().zip(&g_plain) {
                assert_close("checkpointed gradient", a, b, 0.0);
            }
        }
        // Dropout is on: the loss differs from the evaluation loss of the same weights.
        let no_dropout = ModelSpec {
            dropout: 0.0,
            ..spec.clone()
        };
        let (_, loss_off) = gradients(&no_dropout, plain, Engine::Explicit, &batch);
        assert_ne!(
            loss_plain, loss_off,
            "{}: dropout changed nothing",
            spec.name
        );
    }
}

#[test]
fn flash_and_materialized_attention_train_the_same_model() {
    // Both paths draw the same dropout masks, so they agree with dropout on, in every precision.
    for spec in [
        small_seed(0.1),
        ModelSpec {
            dropout: 0.1,
            ..small_gpt()
        },
        ModelSpec {
            dropout: 0.1,
            ..small_llama(false)
        },
    ] {
        let batch = batch(&spec);
        let names = names(&spec);
        // Half precision: the materialised path rounds scores and probabilities to the dtype,
        // the flash path keeps them in f32; the bounds are those half precision is held to
        // against f32 above.
        for (precision, loss_tol, grad_tol) in [
            (Precision::Fp32, 1e-6, 1e-5),
            (Precision::Bf16, 1e-3, 0.5),
            (Precision::Fp16, 1e-3, 0.4),
        ] {
            let knobs = Knobs::new(4, precision);
            let (g_ref, loss_ref) = gradients(&spec, knobs, Engine::ExplicitMaterialized, &batch);
            let (g, loss) = gradients(&spec, knobs, Engine::Explicit, &batch);
            let what = format!("{} {precision}", spec.name);
            assert!(
                ((loss - loss_ref) / loss_ref).abs() < loss_tol,
                "{what}: loss {loss} (flash) vs {loss_ref} (materialized)"
            );
            for ((name, a), b) in names.iter().zip(&g).zip(&g_ref) {
                assert_nonzero_finite(&format!("{what} {name}"), a);
                assert_close(
                    &format!("{what} {name} flash vs materialized"),
                    a,
                    b,
                    grad_tol,
                );
            }
        }
    }
}

/// The epilogue's composite reference: `residual + mask · act(y + bias) / (1 − p)`.
fn epilogue_reference(
    y: &Tensor,
    bias: &Tensor,
    act: Activation,
    mask: &Tensor,
    residual: &Tensor,
) -> Tensor {
    let z = y.broadcast_add(bias).unwrap();
    let a = match act {
        Activation::Relu => z.relu().unwrap(),
        Activation::Gelu => z.gelu().unwrap(),
        Activation::Swiglu => unreachable!("SwiGLU is an op of its own, not an epilogue"),
    };
    (a.mul(mask).unwrap() + residual).unwrap()
}

fn mask_tensor(m: DropoutMask, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let scale = 1.0 / (1.0 - m.p);
    let v: Vec<f32> = (0..n as u64)
        .map(|i| if m.keeps(i) { scale } else { 0.0 })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

#[test]
fn epilogue_and_its_backward_match_autograd() {
    let (rows, cols) = (37, 24);
    let m = DropoutMask { p: 0.25, key: 9 };
    let mask = mask_tensor(m, &[rows, cols]);
    for act in [Activation::Relu, Activation::Gelu] {
        let y = Var::from_tensor(&random(&[rows, cols], 1.5, 0.0, 1, DType::F32)).unwrap();
        let bias = Var::from_tensor(&random(&[cols], 0.5, 0.0, 2, DType::F32)).unwrap();
        let residual = random(&[rows, cols], 1.0, 0.0, 3, DType::F32);
        let dout = random(&[rows, cols], 1.0, 0.0, 4, DType::F32);
        let want = epilogue_reference(y.as_tensor(), bias.as_tensor(), act, &mask, &residual);
        let grads = (&want * &dout)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for dtype in DTYPES {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let got = ops::epilogue(
                &cast(y.as_tensor()),
                Some(bias.as_tensor()),
                Some(act),
                Some(m),
                Some(&cast(&residual)),
            )
            .unwrap();
            assert_eq!(got.dtype(), dtype);
            let what = format!("epilogue {act:?} {dtype:?}");
            // bf16/f16 inputs round y, bias sums and residuals: compare against the reference
            // on the rounded inputs' scale with the dtype's tolerance, twice for two roundings.
            assert_close(&what, &got, &want, 2.0 * tol(dtype));
            let dy = ops::epilogue_backward(
                &cast(&dout),
                &cast(y.as_tensor()),
                Some(bias.as_tensor()),
                Some(act),
                Some(m),
            )
            .unwrap();
            assert_close(
                &format!("{what} dy"),
                &dy,
                grads.get(y.as_tensor()).unwrap(),
                2.0 * tol(dtype),
            );
        }
    }
}

#[test]
fn dropout_masks_drop_the_requested_share_and_depend_only_on_the_key() {
    let n = 200_000u64;
    for p in [0.1f32, 0.5] {
        let m = DropoutMask { p, key: 42 };
        let dropped = (0..n).filter(|&i| !m.keeps(i)).count() as f64 / n as f64;
        assert!(
            (dropped - f64::from(p)).abs() < 0.005,
            "p {p}: dropped {dropped}"
        );
        let other = DropoutMask { p, key: 43 };
        let same = (0..n).filter(|&i| m.keeps(i) == other.keeps(i)).count() as f64 / n as f64;
        // Independent masks agree on p² + (1−p)² of the elements.
        let expect = f64::from(p * p + (1.0 - p) * (1.0 - p));
        assert!((same - expect).abs() < 0.01, "keys 42/43 agree on {same}");
    }
    // The op applies exactly the mask `keeps` describes.
    let x = Tensor::ones((64, 33), DType::F32, &Device::Cpu).unwrap();
    let m = DropoutMask { p: 0.3, key: 5 };
    let got = ops::dropout(&x, m).unwrap();
    assert_close("dropout", &got, &mask_tensor(m, &[64, 33]), 0.0);
}

#[test]
fn embedding_lookup_and_scatter_match_autograd() {
    let (vocab, d, b, s) = (11, 6, 3, 5);
    let table = Var::from_tensor(&random(&[vocab, d], 1.0, 0.0, 7, DType::F32)).unwrap();
    let positions = Var::from_tensor(&random(&[s + 2, d], 1.0, 0.0, 8, DType::F32)).unwrap();
    let ids: Vec<u32> = (0..(b * s) as u32)
        .map(|i| (i * 7 + 3) % vocab as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (b, s), &Device::Cpu).unwrap();
    let m = DropoutMask { p: 0.2, key: 1 };
    let mask = mask_tensor(m, &[b * s, d]);
    let pos = positions.as_tensor().narrow(0, 0, s).unwrap();
    let want = table
        .as_tensor()
        .index_select(&ids.flatten_all().unwrap(), 0)
        .unwrap()
        .reshape((b, s, d))
        .unwrap()
        .broadcast_add(&pos)
        .unwrap()
        .reshape((b * s, d))
        .unwrap()
        .mul(&mask)
        .unwrap();
    let dout = random(&[b * s, d], 1.0, 0.0, 9, DType::F32);
    let grads = (&want * &dout)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let got = ops::embed(
        &ids,
        table.as_tensor(),
        Some(positions.as_tensor()),
        s,
        Some(m),
    )
    .unwrap();
    assert_close("embed", &got, &want, tol(DType::F32));
    let dtable = ops::embed_backward(&ids, &ops::dropout(&dout, m).unwrap(), vocab).unwrap();
    assert_close(
        "embed grad",
        &dtable,
        grads.get(table.as_tensor()).unwrap(),
        tol(DType::F32),
    );
    let bad = Tensor::from_vec(vec![vocab as u32], (1, 1), &Device::Cpu).unwrap();
    assert!(ops::embed(&bad, table.as_tensor(), None, 1, None).is_err());
}

#[test]
fn causal_scaled_softmax_matches_a_masked_composite() {
    let (b, s) = (6, 9);
    let scale = 0.35f32;
    let x = Var::from_tensor(&random(&[b, s, s], 2.0, 0.0, 21, DType::F32)).unwrap();
    let mask: Vec<f32> = (0..s * s)
        .map(|k| {
            if k % s > k / s {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (s, s), &Device::Cpu).unwrap();
    let scaled = (x.as_tensor() * f64::from(scale))
        .unwrap()
        .broadcast_add(&mask)
        .unwrap();
    let want = candle_nn::ops::softmax(&scaled, candle_core::D::Minus1).unwrap();
    let dy = random(&[b, s, s], 1.0, 0.0, 22, DType::F32);
    // Composite gradient: softmax backward by hand (candle_nn's softmax has none).
    let dot = (&want * &dy).unwrap().sum_keepdim(2).unwrap();
    let dx_want = ((dy.broadcast_sub(&dot).unwrap() * &want).unwrap() * f64::from(scale)).unwrap();
    let got = ops::attention_softmax(x.as_tensor(), scale, s).unwrap();
    assert_close("causal softmax", &got, &want, tol(DType::F32));
    let dx = ops::attention_softmax_backward(&got, &dy, scale).unwrap();
    assert_close("causal softmax dx", &dx, &dx_want, tol(DType::F32));
}
