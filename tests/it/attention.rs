//! Flash attention on the CPU against an f64 autograd reference: outputs, log-sum-exps and the
//! gradients of q, k and v, causal or not, with and without dropout and key padding, on fresh
//! random inputs of a sequence length that is no multiple of any tile, at the head widths the
//! CUDA kernels are built for (16 to 128) and one they are not (8).
//!
//! The reference is candle's autograd over f64 primitives (a composite softmax with the row
//! maximum detached, which softmax is invariant to), with the dropout mask built element by
//! element from [`DropoutMask::keeps`]. Tolerances are `ops::tol` (max error relative to the
//! reference's largest magnitude): the flash op computes in f32 from inputs in the tested dtype,
//! so it differs from f64 by f32 rounding and one output rounding.

use candle_core::{DType, Device, Tensor, Var, D};

use autotune::ops::{self, AttentionShape, DropoutMask};

use crate::ops::{assert_close, random, tol, DTYPES};

struct Reference {
    out: Tensor,
    lse: Tensor,
    dqkv: Tensor,
}

/// `(rows, (h + 2·kv)·hd)` → q, k and v as `(b, h, s, hd)` each, the key/value heads repeated
/// for the query heads of their group (a differentiable copy: their gradients sum).
fn split(qkv: &Tensor, shape: &AttentionShape) -> (Tensor, Tensor, Tensor) {
    let (h, kv) = (shape.heads, shape.kv_heads);
    let hd = qkv.dim(1).unwrap() / (h + 2 * kv);
    let part = |start: usize, n: usize| {
        qkv.narrow(1, start * hd, n * hd)
            .unwrap()
            .reshape((shape.batch, shape.seq, n, hd))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    };
    let repeat = |t: Tensor| {
        let heads: Vec<Tensor> = (0..h)
            .map(|i| t.narrow(1, i / (h / kv), 1).unwrap())
            .collect();
        Tensor::cat(&heads, 1).unwrap().contiguous().unwrap()
    };
    (
        part(0, h).contiguous().unwrap(),
        repeat(part(h, kv)),
        repeat(part(h + kv, kv)),
    )
}

fn merge(heads: &Tensor, shape: &AttentionShape) -> Tensor {
    let hd = heads.dim(D::Minus1).unwrap();
    heads
        .permute((0, 2, 1, 3))
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((shape.batch * shape.seq, shape.heads * hd))
        .unwrap()
}

/// The dropout factors of the `(b, h, s, s)` probabilities (1 without dropout).
fn keep_factors(shape: &AttentionShape, mask: Option<DropoutMask>) -> Tensor {
    let n = shape.batch * shape.heads * shape.seq * shape.seq;
    let f: Vec<f64> = (0..n as u64)
        .map(|i| match mask {
            None => 1.0,
            Some(m) if m.keeps(i) => 1.0 / (1.0 - f64::from(m.p)),
            Some(_) => 0.0,
        })
        .collect();
    Tensor::from_vec(
        f,
        (shape.batch, shape.heads, shape.seq, shape.seq),
        &Device::Cpu,
    )
    .unwrap()
}

/// `-inf` at the keys of each sequence from its length on, `(b, 1, 1, s)`.
fn key_padding(shape: &AttentionShape, lens: &[u32]) -> Tensor {
    let s = shape.seq;
    let m: Vec<f64> = (0..shape.batch * s)
        .map(|x| {
            if x % s >= lens[x / s] as usize {
                f64::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(m, (shape.batch, 1, 1, s), &Device::Cpu).unwrap()
}

fn reference(
    qkv: &Tensor,
    dout: &Tensor,
    shape: &AttentionShape,
    mask: Option<DropoutMask>,
    lens: Option<&[u32]>,
) -> Reference {
    let qkv = Var::from_tensor(&qkv.to_dtype(DType::F64).unwrap()).unwrap();
    let (q, k, v) = split(qkv.as_tensor(), shape);
    let hd = q.dim(D::Minus1).unwrap();
    let s = shape.seq;
    let mut scores = (q.matmul(&k.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
    if shape.causal {
        let m: Vec<f64> = (0..s * s)
            .map(|x| {
                if x % s > x / s {
                    f64::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let m = Tensor::from_vec(m, (s, s), &Device::Cpu).unwrap();
        scores = scores.broadcast_add(&m).unwrap();
    }
    if let Some(lens) = lens {
        scores = scores.broadcast_add(&key_padding(shape, lens)).unwrap();
    }
    let max = scores.max_keepdim(D::Minus1).unwrap().detach();
    let e = scores.broadcast_sub(&max).unwrap().exp().unwrap();
    let sum = e.sum_keepdim(D::Minus1).unwrap();
    let lse = (max + sum.log().unwrap())
        .unwrap()
        .squeeze(D::Minus1)
        .unwrap();
    let probs = e.broadcast_div(&sum).unwrap();
    let dropped = (probs * keep_factors(shape, mask)).unwrap();
    let out = merge(&dropped.matmul(&v).unwrap(), shape);
    let loss = (&out * dout.to_dtype(DType::F64).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    Reference {
        out: out.detach(),
        lse: lse.detach(),
        dqkv: grads.get(qkv.as_tensor()).unwrap().clone(),
    }
}

#[test]
fn flash_attention_matches_an_f64_reference() {
    let mask = DropoutMask { p: 0.2, key: 41 };
    let mut seed = 100;
    // Every width the CUDA kernels take beyond 16 and 32 too (64; the wide 80, 96 and 128),
    // which the CPU implementation has no special case for; then query heads sharing key/value
    // heads (Llama 3.2's 32 over 8, Qwen 2.5's 14 over 2, one shared head), which are read in
    // place and whose gradients sum over the group.
    for (batch, seq, heads, kv_heads, hd) in [
        (2, 37, 3, 3, 16),
        (1, 1, 2, 2, 8),
        (1, 70, 1, 1, 32),
        (1, 45, 2, 2, 64),
        (2, 37, 1, 1, 80),
        (1, 45, 2, 2, 96),
        (2, 70, 2, 2, 128),
        (1, 1, 1, 1, 128),
        (2, 37, 4, 2, 16),
        (1, 45, 6, 1, 64),
        (2, 33, 4, 2, 128),
        (1, 70, 3, 1, 32),
    ] {
        for causal in [false, true] {
            for dropout in [None, Some(mask)] {
                for dtype in DTYPES {
                    seed += 1;
                    let shape = AttentionShape {
                        batch,
                        seq,
                        heads,
                        kv_heads,
                        causal,
                    };
                    let width = (heads + 2 * kv_heads) * hd;
                    let qkv = random(&[batch * seq, width], 1.0, 0.0, seed, dtype);
                    let dout = random(&[batch * seq, heads * hd], 1.0, 0.0, seed + 1000, dtype);
                    let want = reference(&qkv, &dout, &shape, dropout, None);
                    let (out, lse) = ops::flash_attention(&qkv, &shape, dropout).unwrap();
                    let dqkv =
                        ops::flash_attention_backward(&qkv, &out, &lse, &dout, &shape, dropout)
                            .unwrap();
                    let what = format!(
                        "b{batch} s{seq} h{heads}/{kv_heads} hd{hd} causal={causal} dropout={} {dtype:?}",
                        dropout.is_some()
                    );
                    assert_eq!(dqkv.dims(), [batch * seq, width], "{what}");
                    assert_eq!(out.dtype(), dtype, "{what}: output dtype");
                    assert_eq!(lse.dtype(), DType::F32, "{what}: lse dtype");
                    assert_eq!(dqkv.dtype(), dtype, "{what}: gradient dtype");
                    assert_close(&format!("{what} out"), &out, &want.out, tol(dtype));
                    assert_close(&format!("{what} lse"), &lse, &want.lse, tol(DType::F32));
                    // The backward pass reads the rounded output (D = dO · O): in half
                    // precision that rounding enters the gradient too.
                    let grad_tol = if dtype == DType::F32 {
                        tol(dtype)
                    } else {
                        2.0 * tol(dtype)
                    };
                    assert_close(&format!("{what} dqkv"), &dqkv, &want.dqkv, grad_tol);
                }
            }
        }
    }
}

#[test]
fn padded_flash_attention_matches_an_f64_reference() {
    let mask = DropoutMask { p: 0.2, key: 43 };
    let mut seed = 300;
    // Lengths of one key, a full sequence, and 64 and 65 (one tile exactly, and one more key);
    // 32 and 33 for the wide heads' 32-row tiles.
    for (batch, seq, heads, hd, lens) in [
        (3, 37, 2, 16, vec![37u32, 20, 1]),
        (2, 70, 1, 32, vec![64, 65]),
        (3, 70, 2, 128, vec![1, 33, 70]),
        (2, 45, 1, 96, vec![32, 45]),
        (2, 40, 1, 80, vec![40, 7]),
    ] {
        for causal in [false, true] {
            for dropout in [None, Some(mask)] {
                for dtype in DTYPES {
                    seed += 1;
                    let shape = AttentionShape {
                        batch,
                        seq,
                        heads,
                        kv_heads: heads,
                        causal,
                    };
                    let d = heads * hd;
                    let qkv = random(&[batch * seq, 3 * d], 1.0, 0.0, seed, dtype);
                    let dout = random(&[batch * seq, d], 1.0, 0.0, seed + 1000, dtype);
                    let want = reference(&qkv, &dout, &shape, dropout, Some(&lens));
                    let lengths = Tensor::new(lens.as_slice(), &Device::Cpu).unwrap();
                    let (out, lse) =
                        ops::flash_attention_padded(&qkv, &shape, dropout, &lengths).unwrap();
                    let dqkv = ops::flash_attention_padded_backward(
                        &qkv, &out, &lse, &dout, &shape, dropout, &lengths,
                    )
                    .unwrap();
                    let what = format!(
                        "b{batch} s{seq} h{heads} hd{hd} lens {lens:?} causal={causal} dropout={} {dtype:?}",
                        dropout.is_some()
                    );
                    assert_close(&format!("{what} out"), &out, &want.out, tol(dtype));
                    assert_close(&format!("{what} lse"), &lse, &want.lse, tol(DType::F32));
                    let grad_tol = if dtype == DType::F32 {
                        tol(dtype)
                    } else {
                        2.0 * tol(dtype)
                    };
                    assert_close(&format!("{what} dqkv"), &dqkv, &want.dqkv, grad_tol);
                    // Padding keys get exactly zero k and v gradients.
                    let g: Vec<f32> = dqkv
                        .to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    for (b, &len) in lens.iter().enumerate() {
                        for j in len as usize..seq {
                            let row = &g[(b * seq + j) * 3 * d..][..3 * d];
                            assert!(
                                row[d..].iter().all(|&x| x == 0.0),
                                "{what}: padding key {j} of sequence {b} got a gradient"
                            );
                        }
                    }
                    // A sequence without padding comes out as the unpadded op computes it.
                    if let Some(full) = lens.iter().position(|&l| l as usize == seq) {
                        let (plain, _) = ops::flash_attention(&qkv, &shape, dropout).unwrap();
                        let rows = |t: &Tensor| t.narrow(0, full * seq, seq).unwrap();
                        assert_close(
                            &format!("{what} unpadded sequence"),
                            &rows(&out),
                            &rows(&plain),
                            0.0,
                        );
                    }
                }
            }
        }
    }
}

/// The position ids of sequences of `seq` tokens holding examples of `lengths` each, one
/// sequence's examples after the other (each sequence's lengths sum to `seq`).
pub fn position_ids(lengths: &[Vec<usize>]) -> Vec<u32> {
    lengths
        .iter()
        .flat_map(|row| row.iter().flat_map(|&n| 0..n as u32))
        .collect()
}

/// Packed attention (forward and backward, any head width, grouped or not) against running
/// each example alone: every example's output rows and q/k/v gradient rows are the ones the
/// example gets on its own, so no token sees across an example.
#[test]
fn packed_flash_attention_equals_each_example_alone() {
    let mut seed = 900;
    for (seq, heads, kv_heads, hd, lengths) in [
        (16, 2, 2, 8, vec![vec![5, 7, 4], vec![16]]),
        (70, 4, 2, 16, vec![vec![1, 64, 5], vec![33, 37]]),
        (45, 2, 1, 128, vec![vec![32, 13], vec![1, 1, 43]]),
        (40, 3, 3, 80, vec![vec![40], vec![7, 7, 7, 19]]),
    ] {
        for dtype in DTYPES {
            seed += 1;
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
            let dout = random(&[batch * seq, d], 1.0, 0.0, seed + 1000, dtype);
            let ids = Tensor::new(position_ids(&lengths).as_slice(), &Device::Cpu).unwrap();
            let (out, lse) = ops::flash_attention_packed(&qkv, &shape, None, &ids).unwrap();
            let dqkv =
                ops::flash_attention_packed_backward(&qkv, &out, &lse, &dout, &shape, None, &ids)
                    .unwrap();
            for (b, row) in lengths.iter().enumerate() {
                let mut at = 0;
                for &n in row {
                    let alone = AttentionShape {
                        batch: 1,
                        seq: n,
                        ..shape
                    };
                    let rows = |t: &Tensor| t.narrow(0, b * seq + at, n).unwrap();
                    let (want_out, want_lse) =
                        ops::flash_attention(&rows(&qkv), &alone, None).unwrap();
                    let want_dqkv = ops::flash_attention_backward(
                        &rows(&qkv),
                        &want_out,
                        &want_lse,
                        &rows(&dout),
                        &alone,
                        None,
                    )
                    .unwrap();
                    let what =
                        format!("s{seq} h{heads}/{kv_heads} hd{hd} {dtype:?} example {b}:{at}+{n}");
                    // The same arithmetic on the same rows: equal up to the order of f32 sums.
                    assert_close(
                        &format!("{what} out"),
                        &rows(&out),
                        &want_out,
                        tol(DType::F32),
                    );
                    let lse_rows = lse.narrow(0, b, 1).unwrap().narrow(2, at, n).unwrap();
                    assert_close(
                        &format!("{what} lse"),
                        &lse_rows,
                        &want_lse,
                        tol(DType::F32),
                    );
                    assert_close(
                        &format!("{what} dqkv"),
                        &rows(&dqkv),
                        &want_dqkv,
                        tol(DType::F32),
                    );
                    at += n;
                }
            }
        }
    }
}

#[test]
fn packed_flash_attention_rejects_positions_that_are_no_examples() {
    let shape = AttentionShape {
        batch: 1,
        seq: 5,
        heads: 2,
        kv_heads: 2,
        causal: true,
    };
    let qkv = random(&[5, 24], 1.0, 0.0, 1, DType::F32);
    for (ids, message) in [
        (vec![0u32, 1, 2, 4, 5], "position id 4 at index 3"),
        (vec![1, 2, 3, 4, 5], "position id 1 at index 0"),
        (vec![0, 1, 2], "must be 5 u32 values"),
    ] {
        let ids = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
        let err = ops::flash_attention_packed(&qkv, &shape, None, &ids).unwrap_err();
        assert!(err.to_string().contains(message), "{err}");
    }
    let both_ways = AttentionShape {
        causal: false,
        ..shape
    };
    let ids = Tensor::new(&[0u32, 1, 0, 1, 2], &Device::Cpu).unwrap();
    let err = ops::flash_attention_packed(&qkv, &both_ways, None, &ids).unwrap_err();
    assert!(err.to_string().contains("need causal attention"), "{err}");
}

#[test]
fn padded_flash_attention_rejects_bad_lengths() {
    let shape = AttentionShape {
        batch: 2,
        seq: 5,
        heads: 2,
        kv_heads: 2,
        causal: true,
    };
    let qkv = random(&[10, 24], 1.0, 0.0, 1, DType::F32);
    for (lens, message) in [
        (vec![5u32, 0], "outside 1..=5"),
        (vec![6, 1], "outside 1..=5"),
        (vec![5], "must be 2 u32 values"),
    ] {
        let lengths = Tensor::new(lens.as_slice(), &Device::Cpu).unwrap();
        let err = ops::flash_attention_padded(&qkv, &shape, None, &lengths).unwrap_err();
        assert!(err.to_string().contains(message), "{lens:?}: {err}");
    }
}

#[test]
fn flash_attention_rejects_mismatched_shapes() {
    let shape = AttentionShape {
        batch: 2,
        seq: 5,
        heads: 2,
        kv_heads: 2,
        causal: true,
    };
    let qkv = random(&[9, 24], 1.0, 0.0, 1, DType::F32);
    let err = ops::flash_attention(&qkv, &shape, None).unwrap_err();
    assert!(err.to_string().contains("do not fit"), "{err}");
    let qkv = random(&[10, 24], 1.0, 0.0, 1, DType::F32);
    let (out, lse) = ops::flash_attention(&qkv, &shape, None).unwrap();
    let wrong = random(&[10, 4], 1.0, 0.0, 2, DType::F32);
    let err = ops::flash_attention_backward(&qkv, &out, &lse, &wrong, &shape, None).unwrap_err();
    assert!(err.to_string().contains("must be [10, 8]"), "{err}");
}

#[test]
fn every_preset_has_flash_attention_kernels() {
    // gpt-1.3b's heads are 128 wide, the others' 16 or 64: on CUDA none may fall back to
    // materialised attention.
    for name in autotune::spec::model::PRESETS {
        let spec = autotune::ModelSpec::preset(name).unwrap();
        assert!(
            ops::FLASH_HEAD_DIMS.contains(&spec.head_dim()),
            "{name}: no CUDA flash attention for heads of {}",
            spec.head_dim()
        );
    }
}
