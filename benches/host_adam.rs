//! The host optimizer's Adam step (what an offloaded step spends its host time on): bytes per
//! second over 16M parameters, on one thread and on every core, in the portable build's lanes
//! and in the widest this CPU has (see `ops::host_optim::lanes`).
//!
//! `cargo bench --bench host_adam`. Each parameter moves 28 bytes: the gradient (2, bf16) and
//! the master, first and second moments (4 each) read and written, and the bf16 working copy
//! (2) written.

// criterion_main! generates an undocumented `main`.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

use autotune::ops::host_optim::{adam_step_on, AdamConsts, HostState, Lanes};
use autotune::parallel::default_threads;
use autotune::spec::model::OptimizerSpec;

fn host_adam(c: &mut Criterion) {
    let n = 16 << 20;
    let consts = AdamConsts::new(&OptimizerSpec::adamw(3e-4), 3);
    let mut master: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3 - 0.5).collect();
    let mut first = vec![0.01f32; n];
    let mut second = vec![0.001f32; n];
    let grads: Vec<half::bf16> = (0..n)
        .map(|i| half::bf16::from_f32((i % 777) as f32 * 1e-4 - 0.03))
        .collect();
    let mut working = vec![half::bf16::ZERO; n];
    let mut group = c.benchmark_group("host_adam");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(28 * n as u64));
    for lanes in [Lanes::Portable, Lanes::detect()] {
        for threads in [1, default_threads()] {
            let id = BenchmarkId::new(format!("{lanes:?}"), format!("{threads} threads"));
            group.bench_function(id, |b| {
                b.iter(|| {
                    let state = HostState {
                        master: &mut master,
                        first: &mut first,
                        second: &mut second,
                        grads: &grads,
                    };
                    adam_step_on(lanes, &consts, state, Some(&mut working), threads);
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, host_adam);
criterion_main!(benches);
