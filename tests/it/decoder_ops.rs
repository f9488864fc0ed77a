//! The ops of Llama-style blocks on the CPU against f64 references built from candle's
//! autograd: RMS norm, SwiGLU (with bias and dropout), and the rotary embedding (whose backward
//! pass is the inverse rotation). Grouped-query attention is in `attention`. Tolerances are
//! `ops::tol` (max error relative to the reference's largest magnitude).

use candle_core::{DType, Device, Tensor, Var, D};

use autotune::ops::{self, DropoutMask, Rotation};
use autotune::spec::model::Rope;

use crate::ops::{assert_close, random, tol, DTYPES};

fn f64s(t: &Tensor) -> Tensor {
    t.to_dtype(DType::F64).unwrap()
}

#[test]
fn rms_norm_and_its_gradients_match_an_f64_reference() {
    for (rows, d) in [(37, 24), (5, 576), (3, 2048)] {
        for dtype in DTYPES {
            let x = random(&[rows, d], 2.0, 0.5, 11, dtype);
            let gamma = random(&[d], 0.5, 1.0, 12, DType::F32);
            let dy = random(&[rows, d], 1.0, 0.0, 13, dtype);
            let eps = 1e-5;
            // Reference: x / √(mean(x²) + eps) · γ in f64.
            let xv = Var::from_tensor(&f64s(&x)).unwrap();
            let gv = Var::from_tensor(&f64s(&gamma)).unwrap();
            let ms = xv
                .as_tensor()
                .sqr()
                .unwrap()
                .mean_keepdim(D::Minus1)
                .unwrap();
            let y = xv
                .as_tensor()
                .broadcast_div(&(ms + eps).unwrap().sqrt().unwrap())
                .unwrap()
                .broadcast_mul(gv.as_tensor())
                .unwrap();
            let grads = (&y * f64s(&dy))
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let what = format!("rms norm {rows}×{d} {dtype:?}");
            let got = ops::rms_norm(&x, &gamma, eps).unwrap();
            assert_eq!(got.dtype(), dtype);
            assert_close(&format!("{what} y"), &got, &y, tol(dtype));
            let (dx, dgamma) = ops::rms_norm_backward(&x, &gamma, &dy, eps).unwrap();
            let grad_tol = 2.0 * tol(dtype);
            assert_close(
                &format!("{what} dx"),
                &dx,
                grads.get(xv.as_tensor()).unwrap(),
                grad_tol,
            );
            assert_close(
                &format!("{what} dgamma"),
                &dgamma,
                grads.get(gv.as_tensor()).unwrap(),
                grad_tol,
            );
        }
    }
}

/// The dropout factors of a `(rows, f)` output (1 without dropout).
fn keep(mask: Option<DropoutMask>, rows: usize, f: usize) -> Tensor {
    let v: Vec<f64> = (0..(rows * f) as u64)
        .map(|i| match mask {
            None => 1.0,
            Some(m) if m.keeps(i) => 1.0 / (1.0 - f64::from(m.p)),
            Some(_) => 0.0,
        })
        .collect();
    Tensor::from_vec(v, (rows, f), &Device::Cpu).unwrap()
}

#[test]
fn swiglu_and_its_gradient_match_an_f64_reference() {
    let mask = DropoutMask { p: 0.25, key: 5 };
    for (rows, f) in [(37, 24), (4, 1536)] {
        for with_bias in [false, true] {
            for dropout in [None, Some(mask)] {
                for dtype in DTYPES {
                    let h = random(&[rows, 2 * f], 2.0, 0.0, 21, dtype);
                    let bias = with_bias.then(|| random(&[2 * f], 0.5, 0.0, 22, DType::F32));
                    let dout = random(&[rows, f], 1.0, 0.0, 23, dtype);
                    // Reference: silu(g + bg) · (u + bu) · mask, in f64.
                    let hv = Var::from_tensor(&f64s(&h)).unwrap();
                    let z = match &bias {
                        Some(b) => hv.as_tensor().broadcast_add(&f64s(b)).unwrap(),
                        None => hv.as_tensor().clone(),
                    };
                    let (g, u) = (z.narrow(1, 0, f).unwrap(), z.narrow(1, f, f).unwrap());
                    let sig = (g.neg().unwrap().exp().unwrap() + 1.0)
                        .unwrap()
                        .recip()
                        .unwrap();
                    let y = ((g * sig).unwrap() * u).unwrap();
                    let y = (y * keep(dropout, rows, f)).unwrap();
                    let grads = (&y * f64s(&dout))
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let what = format!(
                        "swiglu {rows}×{f} bias={with_bias} dropout={} {dtype:?}",
                        dropout.is_some()
                    );
                    let got = ops::swiglu(&h, bias.as_ref(), dropout).unwrap();
                    assert_eq!(got.dims(), [rows, f], "{what}");
                    assert_close(&format!("{what} out"), &got, &y, tol(dtype));
                    let dh = ops::swiglu_backward(&dout, &h, bias.as_ref(), dropout).unwrap();
                    assert_close(
                        &format!("{what} dh"),
                        &dh,
                        grads.get(hv.as_tensor()).unwrap(),
                        2.0 * tol(dtype),
                    );
                }
            }
        }
    }
}

/// The f64 rotation of the first `heads` heads of `x` `(b·s, width)`: Hugging Face's
/// `x·cos + rotate_half(x)·sin` with angles from f32 positions and frequencies, as its
/// `LlamaRotaryEmbedding` computes them.
fn rotated(x: &Tensor, freqs: &[f64], heads: usize, hd: usize, seq: usize, sign: f64) -> Tensor {
    let (rows, width) = x.dims2().unwrap();
    let v: Vec<f64> = f64s(x).flatten_all().unwrap().to_vec1().unwrap();
    let mut out = v.clone();
    let half = hd / 2;
    for r in 0..rows {
        let pos = (r % seq) as f32;
        for h in 0..heads {
            for (p, &f) in freqs.iter().enumerate() {
                let angle = f64::from(pos * f as f32);
                let (sn, cs) = (sign * angle.sin(), angle.cos());
                let (i, j) = (r * width + h * hd + p, r * width + h * hd + p + half);
                out[i] = v[i] * cs - v[j] * sn;
                out[j] = v[j] * cs + v[i] * sn;
            }
        }
    }
    Tensor::from_vec(out, (rows, width), &Device::Cpu).unwrap()
}

#[test]
fn rotary_embedding_matches_an_f64_reference_and_its_backward_undoes_it() {
    let rope = Rope {
        theta: 500_000.0,
        scaling: autotune::spec::model::ModelSpec::preset("llama-3.2-1b")
            .ok()
            .and_then(|s| match s.positions {
                autotune::spec::model::Positions::Rotary(r) => r.scaling,
                _ => None,
            }),
    };
    assert!(
        rope.scaling.is_some(),
        "the llama-3.2-1b preset scales its frequencies"
    );
    // q (4 heads) and k (2 heads) of head width 64, then v, over two sequences of 70.
    let (b, s, heads, kv, hd) = (2, 70, 4, 2, 64);
    let width = (heads + 2 * kv) * hd;
    let freqs = rope.inverse_frequencies(hd);
    let table = ops::rotary::frequencies(&freqs, &Device::Cpu).unwrap();
    for dtype in DTYPES {
        let x = random(&[b * s, width], 1.0, 0.0, 31, dtype);
        let want = rotated(&x, &freqs, heads + kv, hd, s, 1.0);
        let y = x.copy().unwrap();
        ops::rotate_in_place(&y, &table, heads + kv, hd, s, Rotation::Forward).unwrap();
        assert_close(&format!("rotary {dtype:?}"), &y, &want, tol(dtype));
        // The values are not touched.
        let v = |t: &Tensor| t.narrow(1, (heads + kv) * hd, kv * hd).unwrap();
        assert_close("values untouched", &v(&y), &v(&x), 0.0);
        // The backward pass is the transpose: the gradient of Σ rotate(x) · g is rotate⁻¹(g).
        let g = random(&[b * s, width], 1.0, 0.0, 32, dtype);
        let dx = g.copy().unwrap();
        ops::rotate_in_place(&dx, &table, heads + kv, hd, s, Rotation::Backward).unwrap();
        let want_dx = rotated(&g, &freqs, heads + kv, hd, s, -1.0);
        assert_close(
            &format!("rotary backward {dtype:?}"),
            &dx,
            &want_dx,
            tol(dtype),
        );
        if dtype == DType::F32 {
            ops::rotate_in_place(&y, &table, heads + kv, hd, s, Rotation::Backward).unwrap();
            assert_close("rotated back", &y, &x, 1e-5);
        }
    }
}

#[test]
fn gradients_widen_exactly_and_sum_in_place() {
    for dtype in DTYPES {
        let part = random(&[37, 24], 1.0, 0.0, 41, dtype);
        let wide = ops::to_f32(&part).unwrap();
        assert_eq!(wide.dtype(), DType::F32);
        assert_close("widened", &wide, &part.to_dtype(DType::F32).unwrap(), 0.0);
        let acc = random(&[37, 24], 1.0, 0.0, 42, DType::F32).copy().unwrap();
        let want = (&acc + part.to_dtype(DType::F32).unwrap()).unwrap();
        ops::accumulate_into(&acc, &part).unwrap();
        assert_close(&format!("accumulated {dtype:?}"), &acc, &want, 0.0);
    }
    let acc = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
    let wrong = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
    assert!(
        ops::accumulate_into(&acc, &wrong).is_err(),
        "shapes must match"
    );
    let half = Tensor::zeros((2, 3), DType::BF16, &Device::Cpu).unwrap();
    assert!(
        ops::accumulate_into(&half, &acc).is_err(),
        "the sum must be f32"
    );
}

#[test]
fn masters_narrow_as_the_cast_rounds() {
    // Values at and between half-precision neighbours: ties round to even, as the cast does.
    let master = random(&[37, 24], 3.0, 0.0, 46, DType::F32);
    let ties = Tensor::new(
        &[1.0f32 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -2.0e-3, 65520.0],
        &Device::Cpu,
    )
    .unwrap();
    for dtype in [DType::BF16, DType::F16] {
        for x in [&master, &ties] {
            let narrowed = ops::to_half(x, dtype).unwrap();
            assert_eq!(narrowed.dtype(), dtype);
            let cast = x.to_dtype(dtype).unwrap();
            let (a, b) = (
                narrowed
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
                cast.to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            );
            let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{dtype:?}: {a:?} vs {b:?}");
        }
    }
}

#[test]
fn weight_gradients_sum_into_f32_straight_from_their_product() {
    for dtype in DTYPES {
        let (rows, out, width) = (19, 7, 12);
        let dy = random(&[rows, out], 1.0, 0.0, 43, dtype);
        let x = random(&[rows, width], 1.0, 0.0, 44, dtype);
        let acc = random(&[out, width], 1.0, 0.0, 45, DType::F32)
            .copy()
            .unwrap();
        let product = dy.t().unwrap().matmul(&x).unwrap();
        let want = (&acc + product.to_dtype(DType::F32).unwrap()).unwrap();
        ops::accumulate_product_tn(&acc, &dy, &x).unwrap();
        assert_close(&format!("dyᵀ·x into {dtype:?}"), &acc, &want, 0.0);
        // Two parts summed: what the vocabulary head's chunks do.
        let again = (&want + product.to_dtype(DType::F32).unwrap()).unwrap();
        ops::accumulate_product_tn(&acc, &dy, &x).unwrap();
        assert_close("a second part", &acc, &again, 0.0);
    }
    let acc = Tensor::zeros((7, 12), DType::F32, &Device::Cpu).unwrap();
    let dy = Tensor::zeros((5, 7), DType::F32, &Device::Cpu).unwrap();
    let short = Tensor::zeros((4, 12), DType::F32, &Device::Cpu).unwrap();
    assert!(
        ops::accumulate_product_tn(&acc, &dy, &short).is_err(),
        "dy and x must have as many rows"
    );
    let half = Tensor::zeros((7, 12), DType::BF16, &Device::Cpu).unwrap();
    let x = Tensor::zeros((5, 12), DType::F32, &Device::Cpu).unwrap();
    assert!(
        ops::accumulate_product_tn(&half, &dy, &x).is_err(),
        "the sum must be f32"
    );
}

#[test]
fn an_embedding_gradient_adds_into_a_tied_heads_gradient_in_place() {
    let (vocab, d, rows) = (11, 6, 30);
    // Repeated ids: rows of the table that several tokens add to.
    let ids: Vec<u32> = (0..rows as u32)
        .map(|i| (i * 7 + 3) % vocab as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (3, rows / 3), &Device::Cpu).unwrap();
    let d_out = random(&[rows, d], 1.0, 0.0, 46, DType::F32);
    let head = random(&[vocab, d], 1.0, 0.0, 47, DType::F32)
        .copy()
        .unwrap();
    let want = (&head + ops::embed_backward(&ids, &d_out, vocab).unwrap()).unwrap();
    ops::embed_backward_into(&ids, &d_out, &head).unwrap();
    assert_close("head + embeddings", &head, &want, 1e-6);
    let narrow = Tensor::zeros((vocab, d + 1), DType::F32, &Device::Cpu).unwrap();
    assert!(
        ops::embed_backward_into(&ids, &d_out, &narrow).is_err(),
        "the table's width must be the gradient's"
    );
    let small = Tensor::zeros((vocab - 1, d), DType::F32, &Device::Cpu).unwrap();
    assert!(
        ops::embed_backward_into(&ids, &d_out, &small).is_err(),
        "ids past the table's rows are refused on the CPU"
    );
}
