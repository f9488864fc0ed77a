use candle_core::{DType, Device, Tensor};

use autotune::data::source::{Data, DataSpec};
use autotune::knobs::{Checkpointing, Knobs, Offload, Precision};
use autotune::spec::model::{ModelSpec, OptimizerSpec};
use autotune::train::checkpoint;
use autotune::train::optimizer::offload::host_bytes_estimate;
use autotune::train::step::Trainer;

use crate::util::{autotune_in, small_gpt, small_seed, stdout};

/// Largest |a − b| relative to the largest |a| (0 when both are all zeros).
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    let b = b
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    let max = |t: &Tensor| {
        t.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    let diff = max(&(&a - &b).unwrap());
    if diff == 0.0 {
        0.0
    } else {
        diff / max(&a).max(f32::MIN_POSITIVE)
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

/// Four blocks, so that every-2 and every-3 mix recomputed and kept blocks.
fn deeper(spec: ModelSpec) -> ModelSpec {
    ModelSpec {
        n_layers: 4,
        ..spec
    }
}

fn with_regime(checkpointing: Checkpointing, offload: Offload, precision: Precision) -> Knobs {
    Knobs {
        checkpointing,
        offload,
        ..Knobs::new(4, precision)
    }
}

#[test]
fn checkpointed_gradients_equal_the_plain_step() {
    // Dropout > 0 on the post-norm model checks that recomputed blocks redraw their masks.
    for spec in [deeper(small_seed(0.2)), deeper(small_gpt())] {
        for precision in [Precision::Fp32, Precision::Bf16] {
            let data = Data::open(&DataSpec::Random, &spec).unwrap();
            let batches: Vec<_> = (0..2)
                .map(|micro| data.batch(3, 0, micro, 4, &Device::Cpu).unwrap())
                .collect();
            let knobs = |c| with_regime(c, Offload::None, precision);
            let plain = Trainer::new(&spec, knobs(Checkpointing::None), &Device::Cpu, 3).unwrap();
            let (g_plain, loss_plain) = plain.gradients(&batches).unwrap();
            // Recomputation repeats the same operations on the same values, so the gradients
            // agree to the bit in practice; the bound leaves room only for a matrix kernel that
            // picks a different path for differently aligned copies.
            for ckpt in [1, 2, 3].map(Checkpointing::EveryKth) {
                let trainer = Trainer::new(&spec, knobs(ckpt), &Device::Cpu, 3).unwrap();
                let (g, loss) = trainer.gradients(&batches).unwrap();
                assert_eq!(loss, loss_plain, "{} {precision} {ckpt}: loss", spec.name);
                let names = trainer.model().params().names();
                for ((name, a), b) in names.iter().zip(&g_plain).zip(&g) {
                    let rel = rel_diff(a, b);
                    assert!(
                        rel <= 1e-6,
                        "{} {precision} {ckpt}: {name} differs by {rel:e} (relative)",
                        spec.name
                    );
                }
            }
        }
    }
}

#[test]
fn offloaded_adam_matches_on_device_adam_step_for_step() {
    // AdamW with decoupled decay, Adam with L2 decay, and Adam without decay.
    let adam_l2 = ModelSpec {
        optimizer: OptimizerSpec {
            weight_decay: 0.01,
            ..OptimizerSpec::adam(1e-3)
        },
        ..small_seed(0.1)
    };
    // One micro-batch streams each part through the host as the backward pass settles it;
    // two sum the micro-batches on the host first.
    for (spec, grad_accum) in [
        (small_gpt(), 2),
        (adam_l2.clone(), 2),
        (small_seed(0.0), 2),
        (small_gpt(), 1),
        (adam_l2, 1),
        (deeper(small_seed(0.0)), 1),
    ] {
        let data = Data::open(&DataSpec::Pattern, &spec).unwrap();
        let train = |offload| {
            let knobs = Knobs {
                grad_accum,
                ..with_regime(Checkpointing::None, offload, Precision::Fp32)
            };
            let mut t = Trainer::new(&spec, knobs, &Device::Cpu, 4).unwrap();
            let losses: Vec<f64> = (0..5).map(|_| t.step(&data).unwrap().loss).collect();
            (t, losses)
        };
        let (device, device_losses) = train(Offload::None);
        let (host, host_losses) = train(Offload::Optimizer);
        assert_eq!(
            device_losses, host_losses,
            "{} accum {grad_accum}: losses",
            spec.name
        );
        assert_eq!(host.optimizer().steps(), 5);
        // The host update mirrors the on-device one operation for operation, so the two agree
        // bit for bit, not just within rounding.
        let names = device.model().params().names();
        let (a, b) = (
            device.master_weights().unwrap(),
            host.master_weights().unwrap(),
        );
        for ((name, a), b) in names.iter().zip(&a).zip(&b) {
            assert!(
                bits(a) == bits(b),
                "{}: {name} differs by {:e} (relative)",
                spec.name,
                rel_diff(a, b)
            );
        }
        // The device working copies are the masters (fp32) after the upload.
        for (w, m) in host.model().params().vars().iter().zip(&b) {
            assert_eq!(bits(w.as_tensor()), bits(m));
        }
    }
}

#[test]
fn offload_at_bf16_keeps_half_precision_working_copies_and_tracks_on_device_bf16() {
    let spec = small_gpt();
    let data = Data::open(&DataSpec::Pattern, &spec).unwrap();
    let losses = |offload| {
        let knobs = with_regime(Checkpointing::EveryKth(1), offload, Precision::Bf16);
        let mut t = Trainer::new(&spec, knobs, &Device::Cpu, 3).unwrap();
        let l: Vec<f64> = (0..6).map(|_| t.step(&data).unwrap().loss).collect();
        (t, l)
    };
    let (_, device) = losses(Offload::None);
    let (host, offloaded) = losses(Offload::Optimizer);
    for (step, (a, b)) in device.iter().zip(&offloaded).enumerate() {
        assert!((a - b).abs() / a < 0.02, "step {step}: {a} vs {b}");
    }
    assert!(offloaded[5] < offloaded[0], "{offloaded:?}");
    for v in host.model().params().vars() {
        let want = if v.rank() >= 2 {
            DType::BF16
        } else {
            DType::F32
        };
        assert_eq!(v.dtype(), want, "working copy of shape {:?}", v.dims());
    }
    for m in host.master_weights().unwrap() {
        assert_eq!(m.dtype(), DType::F32, "masters stay f32");
    }
}

#[test]
fn resuming_with_checkpointing_and_offload_continues_bit_identically() {
    let spec = deeper(small_seed(0.1));
    let knobs = Knobs {
        grad_accum: 2,
        ..with_regime(
            Checkpointing::EveryKth(2),
            Offload::Optimizer,
            Precision::Fp32,
        )
    };
    let data_spec = DataSpec::Random;
    let data = Data::open(&data_spec, &spec).unwrap();
    let mut straight = Trainer::new(&spec, knobs, &Device::Cpu, 9).unwrap();
    for _ in 0..6 {
        straight.step(&data).unwrap();
    }

    let dir = tempfile::tempdir().unwrap();
    let mut first = Trainer::new(&spec, knobs, &Device::Cpu, 9).unwrap();
    for _ in 0..3 {
        first.step(&data).unwrap();
    }
    checkpoint::save(dir.path(), &first, &data_spec, 0).unwrap();
    drop(first);
    let latest = checkpoint::latest(dir.path())
        .unwrap()
        .expect("a checkpoint");
    // The files hold f32 masters and moments whatever the placement: the checkpoint resumes
    // under offload and on the device alike, and both continue identically.
    let plain_knobs = Knobs {
        offload: Offload::None,
        ..knobs
    };
    for resume_knobs in [knobs, plain_knobs] {
        let mut resumed = Trainer::new(&spec, resume_knobs, &Device::Cpu, 9).unwrap();
        checkpoint::restore(&latest, &mut resumed).unwrap();
        assert_eq!(resumed.steps(), 3);
        for _ in 0..3 {
            resumed.step(&data).unwrap();
        }
        let names = straight.model().params().names();
        let (a, b) = (
            straight.master_weights().unwrap(),
            resumed.master_weights().unwrap(),
        );
        for ((name, a), b) in names.iter().zip(&a).zip(&b) {
            assert!(
                bits(a) == bits(b),
                "{name} differs after resume with offload {}",
                resume_knobs.offload
            );
        }
    }
}

#[test]
fn probe_reports_a_host_budget_breach_as_an_outcome() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "probe",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--offload",
        "optimizer",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--host-budget",
        "1MiB",
        "--json",
    ];
    let out = autotune_in(dir.path(), &args);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let line: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(line["outcome"], "out_of_memory", "{line}");
    assert_eq!(line["memory"], "host", "{line}");
}

/// Peak host bytes of a CPU probe of `model` with `extra` knobs.
fn peak_host(dir: &std::path::Path, model: &str, extra: &[&str]) -> u64 {
    let mut args = vec![
        "probe",
        "--model",
        model,
        "--device",
        "cpu",
        "--micro-batch",
        "16",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = autotune_in(dir, &args);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let line: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    line["peak_host_bytes"].as_u64().expect("peak_host_bytes")
}

#[test]
fn checkpointing_lowers_the_measured_peak_and_offload_state_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("deep.json"),
        r#"{"preset": "tiny", "n_layers": 6}"#,
    )
    .unwrap();
    let plain = peak_host(dir.path(), "deep.json", &[]);
    let all = peak_host(dir.path(), "deep.json", &["--checkpointing", "all"]);
    // On the CPU the activations are heap memory: keeping one block's instead of six shows.
    assert!(
        (all as f64) < 0.7 * plain as f64,
        "checkpointing all: {all} B vs plain {plain} B"
    );
    let offload = peak_host(dir.path(), "deep.json", &["--offload", "optimizer"]);
    // The analytic estimate counts only host state the offload path must allocate, so the
    // allocator has to have seen at least that much.
    let spec = ModelSpec::from_file(&dir.path().join("deep.json")).unwrap();
    let knobs = Knobs {
        offload: Offload::Optimizer,
        ..Knobs::new(16, Precision::Fp32)
    };
    let estimate = host_bytes_estimate(&spec, &knobs);
    assert!(
        offload >= estimate,
        "offload peak {offload} B is below the estimate {estimate} B: host state not counted"
    );
}

#[test]
fn flash_attention_keeps_no_probabilities() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("long.json"),
        r#"{"preset": "tiny", "seq_len": 256}"#,
    )
    .unwrap();
    let flash = peak_host(dir.path(), "long.json", &[]);
    let materialized = peak_host(
        dir.path(),
        "long.json",
        &["--engine", "explicit-materialized"],
    );
    // The materialised path keeps every layer's f32 probabilities (batch · heads · seq²) for
    // the backward pass; most of that must be missing from the flash path's peak.
    let spec = ModelSpec::from_file(&dir.path().join("long.json")).unwrap();
    let probs = 16 * spec.n_layers * spec.n_heads * spec.seq_len * spec.seq_len * 4;
    assert!(
        (flash as f64) < materialized as f64 - 0.75 * probs as f64,
        "flash {flash} B vs materialized {materialized} B; probabilities {probs} B"
    );
}

/// The update in backward against the normal step: the same weights to the bit after several
/// steps, with every engine, precision and checkpointing it may run with. The update in
/// backward takes the head's gradient by rows; the normal step is asked to as well, so the
/// two differ only in when each part is updated (the head by rows against the whole head is
/// `the_head_by_rows_trains_as_the_whole_head`).
#[test]
fn the_update_in_backward_trains_bit_identical_weights() {
    use autotune::knobs::Update;
    use autotune::model::{Engine, HeadGradient};
    for spec in [deeper(small_gpt()), deeper(small_seed(0.2))] {
        let data = Data::open(&DataSpec::Pattern, &spec).unwrap();
        for (precision, checkpointing, engine) in [
            (Precision::Fp32, Checkpointing::None, Engine::Explicit),
            (Precision::Bf16, Checkpointing::None, Engine::Explicit),
            (
                Precision::Bf16,
                Checkpointing::EveryKth(2),
                Engine::Explicit,
            ),
            (Precision::Fp32, Checkpointing::EveryKth(1), Engine::Fused),
        ] {
            let train = |update| {
                let knobs = Knobs {
                    update,
                    ..with_regime(checkpointing, Offload::None, precision)
                };
                let mut trainer = Trainer::new(&spec, knobs, &Device::Cpu, 5).unwrap();
                trainer.set_engine(engine);
                trainer.set_head_gradient(HeadGradient::ByRows).unwrap();
                let losses: Vec<f64> = (0..3).map(|_| trainer.step(&data).unwrap().loss).collect();
                (trainer, losses)
            };
            let (normal, normal_losses) = train(Update::AfterBackward);
            let (fused, fused_losses) = train(Update::InBackward);
            let what = format!("{} {precision} {checkpointing} {engine:?}", spec.name);
            assert_eq!(fused_losses, normal_losses, "{what}: losses");
            let names = normal.model().params().names();
            let params = |t: &Trainer| t.master_weights().unwrap();
            for ((name, a), b) in names.iter().zip(params(&normal)).zip(params(&fused)) {
                assert_eq!(bits(&a), bits(&b), "{what}: {name}");
            }
            // The moments too: a resumed run must continue identically.
            let moments = |t: &Trainer| match t.optimizer() {
                autotune::train::optimizer::OptimizerState::Device(adam) => (0..names.len())
                    .map(|i| {
                        let (m, v) = adam.moments(i).unwrap();
                        (bits(m), bits(v))
                    })
                    .collect::<Vec<_>>(),
                _ => panic!("on-device optimizer expected"),
            };
            assert!(moments(&normal) == moments(&fused), "{what}: moments");
        }
    }
}

/// The head's weight gradient by slices of rows trains what the whole head does, up to the
/// products' summation order, tied or not; the trainer picks it for the exact update in
/// backward only.
#[test]
fn the_head_by_rows_trains_as_the_whole_head() {
    use autotune::knobs::Update;
    use autotune::model::HeadGradient;
    let tied = ModelSpec {
        tied_embeddings: true,
        ..small_gpt()
    };
    for spec in [small_gpt(), tied] {
        let data = Data::open(&DataSpec::Pattern, &spec).unwrap();
        let train = |head| {
            let mut trainer =
                Trainer::new(&spec, Knobs::new(2, Precision::Fp32), &Device::Cpu, 5).unwrap();
            assert_eq!(trainer.head_gradient(), HeadGradient::Whole);
            trainer.set_head_gradient(head).unwrap();
            let losses: Vec<f64> = (0..3).map(|_| trainer.step(&data).unwrap().loss).collect();
            (trainer.master_weights().unwrap(), losses)
        };
        let (whole, whole_losses) = train(HeadGradient::Whole);
        let (rows, rows_losses) = train(HeadGradient::ByRows);
        for (a, b) in whole_losses.iter().zip(&rows_losses) {
            assert!((a - b).abs() <= 1e-5 * a.abs(), "{}: {a} vs {b}", spec.name);
        }
        for (a, b) in whole.iter().zip(&rows) {
            let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
            let diff = diff.to_scalar::<f32>().unwrap();
            assert!(diff <= 1e-4, "{}: weights differ by {diff}", spec.name);
        }
    }
    let fused = Knobs {
        update: Update::InBackward,
        ..Knobs::new(2, Precision::Bf16)
    };
    let trainer = Trainer::new(&small_gpt(), fused, &Device::Cpu, 0).unwrap();
    assert_eq!(trainer.head_gradient(), HeadGradient::ByRows);
}

/// Where the update in backward would not be the normal step, a trainer refuses it and says
/// why, naming the knob.
#[test]
fn the_update_in_backward_is_refused_where_it_is_not_the_normal_step() {
    use autotune::knobs::Update;
    let spec = small_gpt();
    let clipped = ModelSpec {
        optimizer: OptimizerSpec {
            grad_clip: Some(1.0),
            ..spec.optimizer
        },
        ..spec.clone()
    };
    let in_backward = |knobs: Knobs| Knobs {
        update: Update::InBackward,
        ..knobs
    };
    let plain = Knobs::new(4, Precision::Fp32);
    let cases: [(&ModelSpec, Knobs, &str); 4] = [
        (
            &spec,
            Knobs {
                grad_accum: 2,
                ..plain
            },
            "accumulation",
        ),
        (&spec, Knobs::new(4, Precision::Fp16), "fp16"),
        (
            &spec,
            Knobs {
                offload: Offload::Optimizer,
                ..plain
            },
            "offload",
        ),
        (&clipped, plain, "clip"),
    ];
    for (model, knobs, why) in cases {
        let err = match Trainer::new(model, in_backward(knobs), &Device::Cpu, 0) {
            Ok(_) => panic!("{why}: the update in backward was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("update") && err.contains(why), "{why}: {err}");
    }
    // And it is accepted where it is exact.
    Trainer::new(&spec, in_backward(plain), &Device::Cpu, 0).unwrap();
}

/// The state a trainer holds, measured from its tensors, is what the layout's formula says,
/// per component; the update in backward holds one part's gradients instead of all.
#[test]
fn trainer_state_bytes_follow_the_layout_formula() {
    use autotune::knobs::Update;
    use autotune::spec::state::StateBytes;
    let spec = small_gpt();
    let data = Data::open(&DataSpec::Pattern, &spec).unwrap();
    for knobs in [
        Knobs::new(2, Precision::Fp32),
        Knobs::new(2, Precision::Bf16),
        Knobs {
            update: Update::InBackward,
            ..Knobs::new(2, Precision::Bf16)
        },
        Knobs {
            offload: Offload::Optimizer,
            ..Knobs::new(2, Precision::Bf16)
        },
    ] {
        let mut trainer = Trainer::new(&spec, knobs, &Device::Cpu, 0).unwrap();
        trainer.step(&data).unwrap();
        assert_eq!(
            trainer.state_bytes(),
            StateBytes::of(&spec, &knobs),
            "{knobs}"
        );
    }
}

/// Gradient clipping is honoured: a clip far above the gradients' norm changes nothing, a
/// clip below it changes the weights, and clipped training stays deterministic.
#[test]
fn gradient_clipping_by_global_norm_is_honoured() {
    let data_for = |spec: &ModelSpec| Data::open(&DataSpec::Pattern, spec).unwrap();
    let with_clip = |clip: Option<f64>| ModelSpec {
        optimizer: OptimizerSpec {
            grad_clip: clip,
            ..small_gpt().optimizer
        },
        ..small_gpt()
    };
    let train = |spec: &ModelSpec, offload: Offload| {
        let knobs = Knobs {
            offload,
            ..Knobs::new(4, Precision::Fp32)
        };
        let mut trainer = Trainer::new(spec, knobs, &Device::Cpu, 1).unwrap();
        let data = data_for(spec);
        for _ in 0..3 {
            trainer.step(&data).unwrap();
        }
        trainer
            .master_weights()
            .unwrap()
            .iter()
            .map(bits)
            .collect::<Vec<_>>()
    };
    for offload in [Offload::None, Offload::Optimizer] {
        let free = train(&with_clip(None), offload);
        assert_eq!(
            train(&with_clip(Some(1e9)), offload),
            free,
            "{offload}: a loose clip"
        );
        let clipped = train(&with_clip(Some(1e-3)), offload);
        assert_ne!(clipped, free, "{offload}: a tight clip changed nothing");
        assert_eq!(
            train(&with_clip(Some(1e-3)), offload),
            clipped,
            "{offload}: determinism"
        );
    }
    // Clipping on the device (f32 sums of squares) and on the host (f64) agree but for the
    // norm's last bits.
    let close = |a: &[Vec<u32>], b: &[Vec<u32>]| {
        a.iter().flatten().zip(b.iter().flatten()).all(|(x, y)| {
            let (x, y) = (f32::from_bits(*x), f32::from_bits(*y));
            (x - y).abs() <= 1e-4 * x.abs().max(1e-3)
        })
    };
    assert!(close(
        &train(&with_clip(Some(1e-3)), Offload::None),
        &train(&with_clip(Some(1e-3)), Offload::Optimizer)
    ));
}
