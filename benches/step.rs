//! CPU micro-benchmarks of one training step on the tiny preset: per precision with the default
//! engine, and per engine (explicit, fused, composite) at fp32.
//!
//! GPU throughput and memory targets are measured by `benches/gpu/run.sh` on a GPU machine
//! (results under `benches/results/`); this bench tracks the CPU path that tests and the
//! default run use.

// criterion_main! generates an undocumented `main`.
#![allow(missing_docs)]

use candle_core::Device;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

use autotune::data::source::{Data, DataSpec};
use autotune::knobs::{Knobs, Precision};
use autotune::model::Engine;
use autotune::spec::model::ModelSpec;
use autotune::train::step::Trainer;

fn training_step(c: &mut Criterion) {
    let spec = ModelSpec::tiny();
    let data = Data::open(&DataSpec::Pattern, &spec).expect("synthetic data opens");
    let mut group = c.benchmark_group("tiny_step");
    group.sample_size(10);
    for precision in [Precision::Fp32, Precision::Bf16] {
        let knobs = Knobs::new(8, precision);
        group.throughput(Throughput::Elements(
            (knobs.global_batch() * spec.seq_len) as u64,
        ));
        let mut trainer = Trainer::new(&spec, knobs, &Device::Cpu, 0).expect("model builds");
        group.bench_function(BenchmarkId::from_parameter(precision), |b| {
            b.iter(|| trainer.step(&data).expect("step runs"))
        });
    }
    group.finish();
}

fn training_step_per_engine(c: &mut Criterion) {
    let spec = ModelSpec::tiny();
    let data = Data::open(&DataSpec::Pattern, &spec).expect("synthetic data opens");
    let mut group = c.benchmark_group("tiny_step_engine");
    group.sample_size(10);
    let knobs = Knobs::new(8, Precision::Fp32);
    group.throughput(Throughput::Elements(
        (knobs.global_batch() * spec.seq_len) as u64,
    ));
    for engine in [Engine::Explicit, Engine::Fused, Engine::Composite] {
        let mut trainer = Trainer::new(&spec, knobs, &Device::Cpu, 0).expect("model builds");
        trainer.set_engine(engine);
        group.bench_function(BenchmarkId::from_parameter(format!("{engine:?}")), |b| {
            b.iter(|| trainer.step(&data).expect("step runs"))
        });
    }
    group.finish();
}

criterion_group!(benches, training_step, training_step_per_engine);
criterion_main!(benches);
