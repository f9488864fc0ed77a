//! Attention on the CPU, one (sequence, head) at a time: scores, softmax and products in f32
//! with f64 row sums, threads over groups of heads. The maths the CUDA kernels follow, without
//! their tiling.

use super::Args;
use crate::parallel::{default_threads, run_parallel};

/// Row-major views of one (sequence, head) inside the token-major q/k/v rows.
struct Head<'a> {
    qkv: &'a [f32],
    args: &'a Args,
    b: usize,
    h: usize,
}

impl Head<'_> {
    /// Element `c` of token `i`'s q (`part` 0), k (1) or v (2).
    fn at(&self, part: usize, i: usize, c: usize) -> f32 {
        self.qkv[(self.b * self.args.seq + i) * self.args.qkv_width()
            + column(self.args, part, self.h)
            + c]
    }

    fn row(&self, part: usize, i: usize) -> Vec<f32> {
        (0..self.args.head_dim)
            .map(|c| self.at(part, i, c))
            .collect()
    }

    /// Keys query `i` sees: those up to `i` when causal, none of the padding, and only its own
    /// example's in a packed sequence.
    fn seen(&self, i: usize) -> std::ops::Range<usize> {
        let keys = self.args.keys(self.b);
        let end = if self.args.causal {
            (i + 1).min(keys)
        } else {
            keys
        };
        self.args.first_key(self.b, i)..end
    }

    fn bh(&self) -> usize {
        self.b * self.args.heads + self.h
    }
}

/// The first column of query head `h`'s q (`part` 0), or of the k (1) or v (2) of the
/// key/value head it reads.
fn column(args: &Args, part: usize, h: usize) -> usize {
    let hd = args.head_dim;
    match part {
        0 => h * hd,
        1 => (args.heads + args.kv_head(h)) * hd,
        _ => (args.heads + args.kv_heads + args.kv_head(h)) * hd,
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Splits `bh` (sequence, head) pairs into one contiguous group per thread and runs `f(first
/// pair, outputs of the group)` on each; `per_pair` is the output length of one pair.
fn per_group(args: &Args, per_pair: usize, out: &mut [f32], f: impl Fn(usize, &mut [f32]) + Sync) {
    let pairs = args.batch * args.heads;
    let group = pairs.div_ceil(default_threads()).max(1);
    run_parallel(
        out.chunks_mut(group * per_pair).enumerate(),
        |(g, chunk)| f(g * group, chunk),
    );
}

/// `(output rows (batch·seq, d), log-sum-exp (batch, heads, seq))`.
pub(super) fn forward(qkv: &[f32], args: &Args) -> (Vec<f32>, Vec<f32>) {
    let (s, hd) = (args.seq, args.head_dim);
    // Per pair: s·hd output values (head-major) then s log-sum-exps.
    let per_pair = s * hd + s;
    let mut scratch = vec![0f32; args.batch * args.heads * per_pair];
    per_group(args, per_pair, &mut scratch, |first, chunk| {
        for (n, pair) in chunk.chunks_mut(per_pair).enumerate() {
            let bh = first + n;
            let head = Head {
                qkv,
                args,
                b: bh / args.heads,
                h: bh % args.heads,
            };
            let (out, lse) = pair.split_at_mut(s * hd);
            forward_head(&head, out, lse);
        }
    });
    let d = args.width();
    let mut out = vec![0f32; args.batch * s * d];
    let mut lse = vec![0f32; args.batch * args.heads * s];
    for (bh, pair) in scratch.chunks(per_pair).enumerate() {
        let (b, h) = (bh / args.heads, bh % args.heads);
        for i in 0..s {
            let dst = (b * s + i) * d + h * hd;
            out[dst..dst + hd].copy_from_slice(&pair[i * hd..(i + 1) * hd]);
        }
        lse[bh * s..(bh + 1) * s].copy_from_slice(&pair[s * hd..]);
    }
    (out, lse)
}

fn forward_head(head: &Head, out: &mut [f32], lse: &mut [f32]) {
    let (s, hd, scale) = (head.args.seq, head.args.head_dim, head.args.scale);
    let keys: Vec<Vec<f32>> = (0..s).map(|j| head.row(1, j)).collect();
    let values: Vec<Vec<f32>> = (0..s).map(|j| head.row(2, j)).collect();
    let mut p = vec![0f32; s];
    for i in 0..s {
        let q = head.row(0, i);
        let seen = head.seen(i);
        let mut max = f32::NEG_INFINITY;
        for j in seen.clone() {
            p[j] = scale * dot(&q, &keys[j]);
            max = max.max(p[j]);
        }
        let mut sum = 0f64;
        for v in &mut p[seen.clone()] {
            *v = (*v - max).exp();
            sum += f64::from(*v);
        }
        lse[i] = max + sum.ln() as f32;
        let inv = (1.0 / sum) as f32;
        let o = &mut out[i * hd..(i + 1) * hd];
        o.fill(0.0);
        for j in seen {
            let w = p[j] * inv * head.args.keep_factor(head.bh(), i, j);
            if w != 0.0 {
                for (oc, vc) in o.iter_mut().zip(&values[j]) {
                    *oc += w * vc;
                }
            }
        }
    }
}

/// The gradient of the q/k/v rows, `(batch·seq, (heads + 2·kv_heads)·hd)`: a shared key/value
/// head's gradient sums those of the query heads that read it.
pub(super) fn backward(
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    args: &Args,
) -> Vec<f32> {
    let (s, hd, d) = (args.seq, args.head_dim, args.width());
    // Per pair: dq, dk, dv, each s·hd head-major.
    let per_pair = 3 * s * hd;
    let mut scratch = vec![0f32; args.batch * args.heads * per_pair];
    per_group(args, per_pair, &mut scratch, |first, chunk| {
        for (n, pair) in chunk.chunks_mut(per_pair).enumerate() {
            let bh = first + n;
            let (b, h) = (bh / args.heads, bh % args.heads);
            let head = Head { qkv, args, b, h };
            // This pair's output and output-gradient rows, head-major.
            let rows = |m: &[f32]| -> Vec<Vec<f32>> {
                (0..s)
                    .map(|i| m[(b * s + i) * d + h * hd..][..hd].to_vec())
                    .collect()
            };
            backward_head(
                &head,
                &rows(out),
                &rows(dout),
                &lse[bh * s..(bh + 1) * s],
                pair,
            );
        }
    });
    let width = args.qkv_width();
    let mut dqkv = vec![0f32; args.batch * s * width];
    for (bh, pair) in scratch.chunks(per_pair).enumerate() {
        let (b, h) = (bh / args.heads, bh % args.heads);
        for part in 0..3 {
            for i in 0..s {
                let src = (part * s + i) * hd;
                let dst = (b * s + i) * width + column(args, part, h);
                for (out, g) in dqkv[dst..dst + hd].iter_mut().zip(&pair[src..src + hd]) {
                    *out += g;
                }
            }
        }
    }
    dqkv
}

/// `grads` holds dq, dk and dv of the head, each `seq × hd`.
fn backward_head(head: &Head, out: &[Vec<f32>], dout: &[Vec<f32>], lse: &[f32], grads: &mut [f32]) {
    let (s, hd, scale) = (head.args.seq, head.args.head_dim, head.args.scale);
    let (dq, rest) = grads.split_at_mut(s * hd);
    let (dk, dv) = rest.split_at_mut(s * hd);
    let queries: Vec<Vec<f32>> = (0..s).map(|i| head.row(0, i)).collect();
    let keys: Vec<Vec<f32>> = (0..s).map(|j| head.row(1, j)).collect();
    let values: Vec<Vec<f32>> = (0..s).map(|j| head.row(2, j)).collect();
    for i in 0..s {
        // D_i = dO_i · O_i = Σ_j P_ij dP_ij, with the output as the forward pass rounded it.
        let delta = dot(&dout[i], &out[i]);
        for j in head.seen(i) {
            let p = (scale * dot(&queries[i], &keys[j]) - lse[i]).exp();
            let z = head.args.keep_factor(head.bh(), i, j);
            for c in 0..hd {
                dv[j * hd + c] += p * z * dout[i][c];
            }
            let ds = p * (dot(&dout[i], &values[j]) * z - delta);
            for c in 0..hd {
                dq[i * hd + c] += scale * ds * keys[j][c];
                dk[j * hd + c] += scale * ds * queries[i][c];
            }
        }
    }
}
