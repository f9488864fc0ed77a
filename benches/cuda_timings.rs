//! GPU timings of single kernels, printed for the record (not a correctness check: those are
//! the `cuda_*` integration tests): flash attention at the seed's, gpt-124m's and gpt-1.3b's
//! attention shapes, the fused ops against their composite references, and the host's cost per
//! queued op. Run on a GPU machine with `cargo bench --features cuda --bench cuda_timings`;
//! `benches/gpu/sdpa_ref.py` times PyTorch's attention at the same shapes, in the same format.
//!
//! Each time is the median (or mean, for the fused ops) of repeated runs after warm-ups, with
//! the device synchronised before every clock read; inputs are random, never zeros.

// A bench binary prints its results; its `main` needs no docs.
#![allow(missing_docs, clippy::print_stdout)]

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};

use autotune::model::layers::{self, Norm};
use autotune::model::params::ParamStore;
use autotune::model::Engine;
use autotune::ops::{self, AttentionShape, DropoutMask};
use autotune::spec::model::NormKind;

fn main() {
    let dev = Device::new_cuda(0).expect("this bench needs a CUDA device");
    flash_attention(&dev);
    fused_ops(&dev);
    host_time_per_op(&dev);
}

/// Random values of `shape` in `dtype` on `dev`.
fn random(shape: &[usize], dtype: DType, dev: &Device) -> Tensor {
    Tensor::randn(0f32, 1f32, shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_device(dev))
        .expect("random input")
}

/// `rows` random class indices below `classes`, on `dev`.
fn targets(rows: usize, classes: usize, dev: &Device) -> Tensor {
    Tensor::rand(0f32, classes as f32, rows, &Device::Cpu)
        .and_then(|t| t.floor())
        .and_then(|t| t.to_dtype(DType::U32))
        .and_then(|t| t.to_device(dev))
        .expect("random targets")
}

/// Median milliseconds of `f` over `reps` runs after three warm-ups.
fn median_ms(dev: &Device, reps: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    dev.synchronize().expect("device sync");
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            dev.synchronize().expect("device sync");
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

/// Forward and backward times with the rates they reach counting the useful products only
/// (forward 4·b·h·s²·hd, backward 2.5× that, half of each when causal), for comparison with the
/// ~780 TFLOP/s bf16 ceiling of the H200. The shapes are those of `benches/gpu/sdpa_ref.py`.
fn flash_attention(dev: &Device) {
    let seed_dropout = Some(DropoutMask { p: 0.1, key: 3 });
    for (name, batch, seq, heads, hd, causal, dropout) in [
        ("seed b512", 512, 128, 8, 64, false, seed_dropout),
        ("gpt-124m b16", 16, 1024, 12, 64, true, None),
        ("gpt-1.3b b1", 1, 1024, 16, 128, true, None),
        ("gpt-1.3b b2", 2, 1024, 16, 128, true, None),
        ("gpt-1.3b b8", 8, 1024, 16, 128, true, None),
    ] {
        let shape = AttentionShape {
            batch,
            seq,
            heads,
            kv_heads: heads,
            causal,
        };
        let d = heads * hd;
        let qkv = random(&[batch * seq, 3 * d], DType::BF16, dev);
        let dout = random(&[batch * seq, d], DType::BF16, dev);
        let (out, lse) = ops::flash_attention(&qkv, &shape, dropout).expect("forward");
        let fwd = median_ms(dev, 20, || {
            ops::flash_attention(&qkv, &shape, dropout).expect("forward");
        });
        let bwd = median_ms(dev, 20, || {
            ops::flash_attention_backward(&qkv, &out, &lse, &dout, &shape, dropout)
                .expect("backward");
        });
        let flops = 4.0
            * (batch * heads) as f64
            * (seq * seq) as f64
            * hd as f64
            * if causal { 0.5 } else { 1.0 };
        println!(
            "flash {name} bf16 (s {seq}, h {heads}, hd {hd}, causal {causal}, dropout {}): forward {fwd:.3} ms ({:.0} TFLOP/s), backward {bwd:.3} ms ({:.0} TFLOP/s)",
            dropout.is_some(),
            flops / fwd / 1e9,
            2.5 * flops / bwd / 1e9
        );
    }
}

/// Forward + backward time of each fused op against its composite reference.
fn fused_ops(dev: &Device) {
    let time = |label: &str, f: &dyn Fn()| {
        f();
        dev.synchronize().expect("device sync");
        let n = 20;
        let start = Instant::now();
        for _ in 0..n {
            f();
        }
        dev.synchronize().expect("device sync");
        let ms = start.elapsed().as_secs_f64() * 1e3 / n as f64;
        println!("cuda timing {label:<46} {ms:8.3} ms (forward + backward)");
    };
    for dtype in [DType::F32, DType::BF16] {
        let name = format!("{dtype:?}").to_lowercase();
        let logits = random(&[8192, 10_000], dtype, dev);
        let t = targets(8192, 10_000, dev);
        for engine in [Engine::Fused, Engine::Composite] {
            time(
                &format!("cross-entropy 8192x10000 {name} {engine:?}"),
                &|| {
                    let v = Var::from_tensor(&logits).expect("var");
                    let loss =
                        layers::cross_entropy(v.as_tensor(), &t, None, engine).expect("loss");
                    loss.backward().expect("backward");
                },
            );
        }
        let scores = random(&[32, 8, 128, 128], dtype, dev);
        for engine in [Engine::Fused, Engine::Composite] {
            time(&format!("softmax 32x8x128x128 {name} {engine:?}"), &|| {
                let v = Var::from_tensor(&scores).expect("var");
                let y = layers::softmax_last_dim(v.as_tensor(), engine).expect("softmax");
                y.sum_all().and_then(|s| s.backward()).expect("backward");
            });
        }
        let x = random(&[64, 128, 512], dtype, dev);
        let mut store = ParamStore::new(dev, 0);
        let norm = Norm::new(&mut store, "norm", 512, 1e-5, NormKind::Layer).expect("layer norm");
        for engine in [Engine::Fused, Engine::Composite] {
            time(&format!("layer-norm 64x128x512 {name} {engine:?}"), &|| {
                let v = Var::from_tensor(&x).expect("var");
                let y = norm.forward(v.as_tensor(), engine).expect("norm");
                y.sum_all().and_then(|s| s.backward()).expect("backward");
            });
        }
    }
}

/// What the host spends per launch, the bound on how fast small kernels can be fed: 2,000
/// queued ops of each kind on tiny tensors, the time to queue them (no wait) and to finish.
fn host_time_per_op(dev: &Device) {
    let a = random(&[1024], DType::BF16, dev);
    let b = random(&[1024], DType::BF16, dev);
    let m = random(&[64, 64], DType::BF16, dev);
    let square = a.reshape((32, 32)).expect("reshape");
    let kinds: [(&str, &dyn Fn() -> Tensor); 4] = [
        ("candle add", &|| (&a + &b).expect("add")),
        ("candle cast", &|| a.to_dtype(DType::F32).expect("cast")),
        ("candle matmul 64", &|| m.matmul(&m).expect("matmul")),
        ("epilogue (ours)", &|| {
            ops::epilogue(&square, None, None, None, None).expect("epilogue")
        }),
    ];
    for (name, op) in kinds {
        for _ in 0..100 {
            op();
        }
        dev.synchronize().expect("device sync");
        let n = 2000;
        let t = Instant::now();
        for _ in 0..n {
            op();
        }
        let queued = t.elapsed().as_secs_f64();
        dev.synchronize().expect("device sync");
        let done = t.elapsed().as_secs_f64();
        println!(
            "host per op {name:<18}: queue {:.2} µs, done {:.2} µs",
            queued / n as f64 * 1e6,
            done / n as f64 * 1e6
        );
    }
}
