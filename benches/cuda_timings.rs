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
    // `cuda_timings fp8` (any argument naming sections) runs only those; none runs them all.
    let asked: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wants = |section: &str| asked.is_empty() || asked.iter().any(|a| a == section);
    if wants("attention") {
        flash_attention(&dev);
    }
    if wants("fused") {
        fused_ops(&dev);
    }
    if wants("host") {
        host_time_per_op(&dev);
    }
    if wants("fp8") {
        fp8_products(&dev);
    }
}

/// The block products of gpt-1.3b at micro-batch 4 (4,096 rows of width 2,048, the MLP 8,192
/// wide), each in bf16 (candle's cuBLAS product) and in fp8 (cuBLASLt, E4M3 × E4M3, bf16 out):
/// the product alone from operands converted beforehand, and with the activation's conversion
/// (its largest magnitude, scale and codes), as a step pays it when the weight's codes are
/// kept. The backward's products have the same sizes.
fn fp8_products(dev: &Device) {
    use autotune::ops::fp8::{self, Fp8Format, OperandLayout};
    let Device::Cuda(_) = dev else { return };
    if !fp8::has_fp8_tensor_cores(dev).expect("compute capability") {
        println!("cuda timing fp8: this GPU has no fp8 tensor cores (compute capability < 8.9)");
        return;
    }
    let rows = 4096;
    for (name, k, n) in [
        ("qkv", 2048, 6144),
        ("attention out", 2048, 2048),
        ("mlp up", 2048, 8192),
        ("mlp down", 8192, 2048),
    ] {
        let x = random(&[rows, k], DType::BF16, dev);
        let w = random(&[n, k], DType::BF16, dev);
        let flops = 2.0 * (rows * k * n) as f64;
        let wt = w.t().expect("transpose");
        let bf16 = median_ms(dev, 20, || {
            x.matmul(&wt).expect("bf16 product");
        });
        let quantize = |t: &Tensor| {
            fp8::quantize_operand(t, Fp8Format::E4m3, OperandLayout::Rows).expect("quantize")
        };
        let (qx, qw) = (quantize(&x), quantize(&w));
        let product = median_ms(dev, 20, || {
            fp8::fp8_product(&qx, &qw, DType::BF16).expect("fp8 product");
        });
        let with_conversion = median_ms(dev, 20, || {
            fp8::fp8_product(&quantize(&x), &qw, DType::BF16).expect("fp8 product");
        });
        let rate = |ms: f64| flops / (ms * 1e-3) / 1e12;
        println!(
            "cuda timing fp8 {name:<14} {rows}x{k}x{n}: bf16 {bf16:7.3} ms ({:5.0} TFLOP/s), \
             fp8 {product:7.3} ms ({:5.0} TFLOP/s, {:.2}x), with the input's conversion \
             {with_conversion:7.3} ms ({:.2}x)",
            rate(bf16),
            rate(product),
            bf16 / product,
            bf16 / with_conversion,
        );
    }
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
