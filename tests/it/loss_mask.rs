//! The loss counts only the targets a batch's mask counts (an assistant's reply, a completion,
//! never padding): a mask that counts every target changes nothing, a masked target's class
//! changes nothing, and a sequence masked whole adds nothing to the loss or the gradients of
//! the others. In every engine.

use candle_core::{Device, Tensor};

use autotune::knobs::{Knobs, Precision};
use autotune::model::batch::{Batch, LossMask};
use autotune::model::Engine;
use autotune::spec::model::ModelSpec;
use autotune::train::step::Trainer;

use crate::util::{small_gpt, small_llama};

const ENGINES: [Engine; 4] = [
    Engine::Explicit,
    Engine::ExplicitMaterialized,
    Engine::Fused,
    Engine::Composite,
];

/// Gradients (flattened) and loss of `batch` for `spec` in `engine`, from the same weights.
fn run(spec: &ModelSpec, engine: Engine, batch: &Batch) -> (Vec<Vec<f32>>, f64) {
    let sequences = batch.sequences();
    let mut trainer = Trainer::new(
        spec,
        Knobs::new(sequences, Precision::Fp32),
        &Device::Cpu,
        5,
    )
    .unwrap();
    trainer.set_engine(engine);
    let (grads, loss) = trainer.gradients(std::slice::from_ref(batch)).unwrap();
    let grads = grads
        .iter()
        .map(|g| g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect();
    (grads, loss)
}

/// Two sequences of `spec`'s length: deterministic token ids, targets the next id.
fn tokens(spec: &ModelSpec, sequences: usize) -> (Vec<u32>, Vec<u32>) {
    let s = spec.seq_len;
    let v = spec.vocab_size as u32;
    let inputs: Vec<u32> = (0..sequences * s).map(|i| (i as u32 * 7 + 3) % v).collect();
    let targets: Vec<u32> = (0..sequences * s)
        .map(|i| (i as u32 * 7 + 10) % v)
        .collect();
    (inputs, targets)
}

fn batch(spec: &ModelSpec, inputs: &[u32], targets: &[u32], weights: Option<&[f32]>) -> Batch {
    let s = spec.seq_len;
    let sequences = inputs.len() / s;
    let device = Device::Cpu;
    let mut batch = Batch::new(
        Tensor::from_slice(inputs, (sequences, s), &device).unwrap(),
        Tensor::from_slice(targets, sequences * s, &device).unwrap(),
    );
    batch.mask = weights.map(|w| LossMask {
        weights: Tensor::from_slice(w, w.len(), &device).unwrap(),
        counted: w.iter().filter(|&&x| x > 0.0).count(),
    });
    batch
}

fn assert_close(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    for (i, (a, b)) in a.iter().zip(b).enumerate() {
        let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-5 * scale,
                "{what}: parameter {i}: {x} against {y} (scale {scale})"
            );
        }
    }
}

#[test]
fn a_mask_that_counts_every_target_changes_nothing() {
    for spec in [small_gpt(), small_llama(true)] {
        let (inputs, targets) = tokens(&spec, 2);
        let ones = vec![1.0f32; targets.len()];
        for engine in ENGINES {
            let plain = run(&spec, engine, &batch(&spec, &inputs, &targets, None));
            let masked = run(&spec, engine, &batch(&spec, &inputs, &targets, Some(&ones)));
            assert_eq!(plain.1.to_bits(), masked.1.to_bits(), "{engine:?} loss");
            assert_eq!(plain.0, masked.0, "{engine:?} gradients, bit for bit");
        }
    }
}

#[test]
fn masked_targets_count_for_nothing() {
    for spec in [small_gpt(), small_llama(true)] {
        let s = spec.seq_len;
        let (inputs, targets) = tokens(&spec, 2);
        // The first sequence trains on its second half (a reply after a prompt); the second
        // sequence not at all (padding).
        let weights: Vec<f32> = (0..2 * s)
            .map(|i| if i < s && i >= s / 2 { 1.0 } else { 0.0 })
            .collect();
        // Other classes where nothing counts.
        let mut other = targets.clone();
        for (t, w) in other.iter_mut().zip(&weights) {
            if *w == 0.0 {
                *t = (*t + 5) % spec.vocab_size as u32;
            }
        }
        // The first sequence alone, with its first half masked.
        let alone = batch(&spec, &inputs[..s], &targets[..s], Some(&weights[..s]));
        for engine in ENGINES {
            let masked = run(
                &spec,
                engine,
                &batch(&spec, &inputs, &targets, Some(&weights)),
            );
            let moved = run(
                &spec,
                engine,
                &batch(&spec, &inputs, &other, Some(&weights)),
            );
            assert_eq!(masked.1.to_bits(), moved.1.to_bits(), "{engine:?}: loss");
            assert_eq!(
                masked.0, moved.0,
                "{engine:?}: a masked target's class is not read"
            );
            let single = run(&spec, engine, &alone);
            assert!(
                (masked.1 - single.1).abs() <= 1e-6 * single.1.abs(),
                "{engine:?}: a sequence masked whole adds nothing: {} against {}",
                masked.1,
                single.1
            );
            assert_close(&masked.0, &single.0, &format!("{engine:?}"));
            let plain = run(&spec, engine, &batch(&spec, &inputs, &targets, None));
            assert!(
                (masked.1 - plain.1).abs() > 1e-4,
                "{engine:?}: the mask changes the loss"
            );
        }
    }
}
