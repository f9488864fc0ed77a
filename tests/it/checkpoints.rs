//! Checkpoints that can be trusted unattended: preemption saves, one run per directory,
//! damaged or non-finite checkpoints are refused, and old ones are pruned.

use std::path::Path;

use candle_core::Device;

use autotune::data::source::DataSpec;
use autotune::knobs::{Knobs, Precision};
use autotune::train::checkpoint::{self, manifest::Manifest};
use autotune::train::step::Trainer;

use crate::util::{autotune_in, exit_code, read_until, signal, spawn_in, stderr, stdout};

/// A long tiny run into `ck`, checkpointing only when stopped.
const LONG_RUN: [&str; 12] = [
    "train",
    "--model",
    "tiny",
    "--micro-batch",
    "2",
    "--data",
    "pattern",
    "--steps",
    "1000000",
    "--checkpoint-every",
    "1000000",
    "--checkpoint-dir",
];

fn latest_step(dir: &Path) -> u64 {
    let name = std::fs::read_to_string(dir.join("latest")).expect("latest exists");
    name.trim()["step-".len()..]
        .parse()
        .expect("latest names a step")
}

#[test]
fn sigterm_and_sighup_checkpoint_and_exit_130_as_an_interrupt_does() {
    for sig in ["-TERM", "-HUP"] {
        let dir = tempfile::tempdir().unwrap();
        let (child, rx) = spawn_in(dir.path(), &[&LONG_RUN[..], &["ck"]].concat());
        read_until(&rx, "step 1:");
        signal(child.id(), sig);
        assert_eq!(exit_code(child), Some(130), "{sig}");
        let ck = dir.path().join("ck");
        let step = latest_step(&ck);
        assert!(step >= 1, "{sig}: latest is step {step}");
        checkpoint::verify(&ck.join(format!("step-{step:06}"))).unwrap();
    }
}

#[test]
fn a_second_run_on_a_directory_in_use_is_refused_and_leaves_no_mixture() {
    let dir = tempfile::tempdir().unwrap();
    let (first, rx) = spawn_in(dir.path(), &[&LONG_RUN[..], &["ck"]].concat());
    read_until(&rx, "step 1:");
    let second = [
        "train",
        "--model",
        "tiny",
        "--steps",
        "3",
        "--checkpoint-dir",
        "ck",
    ];
    let out = autotune_in(dir.path(), &second);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("in use by another autotune run"),
        "{}",
        stderr(&out)
    );
    let out = autotune_in(dir.path(), &[&second[..], &["--resume"]].concat());
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    signal(first.id(), "-INT");
    assert_eq!(exit_code(first), Some(130));
    // Only the first run wrote: one checkpoint, of its stop.
    let ck = dir.path().join("ck");
    let steps = autotune::train::checkpoint_dir::checkpoints(&ck).unwrap();
    assert_eq!(steps.len(), 1, "{steps:?}");
    assert_eq!(steps[0].0, latest_step(&ck));
}

/// `train` of tiny for `steps` steps into `ck`, a checkpoint every step.
fn train(dir: &Path, steps: &str, extra: &[&str]) -> std::process::Output {
    let args = [
        "train",
        "--model",
        "tiny",
        "--micro-batch",
        "2",
        "--data",
        "pattern",
        "--checkpoint-every",
        "1",
        "--checkpoint-dir",
        "ck",
        "--steps",
        steps,
    ];
    autotune_in(dir, &[&args[..], extra].concat())
}

#[test]
fn a_directory_holding_checkpoints_is_refused_without_resume_or_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let out = train(dir.path(), "4", &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let ck = dir.path().join("ck");
    let out = train(dir.path(), "2", &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--resume") && stderr(&out).contains("--overwrite"));
    assert_eq!(latest_step(&ck), 4, "the refused run moved nothing");
    assert_eq!(
        autotune::train::checkpoint_dir::checkpoints(&ck)
            .unwrap()
            .len(),
        4
    );
    let out = train(dir.path(), "2", &["--overwrite", "--keep-last", "1"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let steps: Vec<u64> = autotune::train::checkpoint_dir::checkpoints(&ck)
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(
        steps,
        vec![2],
        "--overwrite removed the old run, --keep-last 1 kept the newest"
    );
    assert_eq!(latest_step(&ck), 2);
}

#[test]
fn temporaries_of_a_dead_save_are_swept_and_retention_keeps_the_newest() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    std::fs::create_dir_all(ck.join(".step-000007.tmp-4242")).unwrap();
    let out = train(dir.path(), "5", &["--keep-last", "2"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!ck.join(".step-000007.tmp-4242").exists());
    let names: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    let mut names = names;
    names.sort();
    assert_eq!(names, ["latest", "step-000004", "step-000005"]);
}

#[test]
fn a_flipped_byte_in_the_weights_is_refused_naming_the_newest_intact_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = train(dir.path(), "2", &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let weights = dir.path().join("ck/step-000002/model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    // Inside the tensor data (the header is at the front): still a valid file, other numbers.
    let at = bytes.len() - 100;
    bytes[at] ^= 0x40;
    std::fs::write(&weights, bytes).unwrap();
    let out = train(dir.path(), "4", &["--resume"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("step-000002") && err.contains("damaged") && err.contains("model.safetensors"),
        "{err}"
    );
    assert!(
        err.contains("newest intact checkpoint is") && err.contains("step-000001"),
        "{err}"
    );
    assert_eq!(
        latest_step(&dir.path().join("ck")),
        2,
        "nothing was written"
    );
}

#[test]
fn latest_cannot_point_outside_its_directory() {
    let dir = tempfile::tempdir().unwrap();
    let out = train(dir.path(), "1", &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    std::fs::write(dir.path().join("ck/latest"), "../elsewhere/step-000001").unwrap();
    let out = train(dir.path(), "2", &["--resume"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("not a checkpoint of this directory"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_diverging_run_stops_with_exit_1_and_its_non_finite_state_never_becomes_latest() {
    let dir = tempfile::tempdir().unwrap();
    // A step this large overflows the weights within a few updates.
    std::fs::write(
        dir.path().join("wild.json"),
        r#"{"preset": "tiny", "optimizer": {"lr": 1e38}}"#,
    )
    .unwrap();
    let args = [
        "train",
        "--model",
        "wild.json",
        "--micro-batch",
        "2",
        "--data",
        "pattern",
        "--steps",
        "50",
        "--checkpoint-every",
        "1",
        "--checkpoint-dir",
        "ck",
        "--json",
    ];
    let out = autotune_in(dir.path(), &args);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("diverged at step"),
        "{}",
        stderr(&out)
    );
    let report: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let diverged_at = report["diverged"]["step"]
        .as_u64()
        .expect("the report says where");
    let ck = dir.path().join("ck");
    for (step, path) in autotune::train::checkpoint_dir::checkpoints(&ck).unwrap() {
        assert!(
            step < diverged_at,
            "step {step} saved at or after the divergence"
        );
        checkpoint::verify(&path).unwrap();
    }
    if ck.join("latest").exists() {
        assert!(latest_step(&ck) < diverged_at);
    }
}

#[test]
fn a_checkpoint_with_nan_weights_is_never_saved_and_a_sealed_one_stops_a_resume() {
    let spec = autotune::ModelSpec::tiny();
    let knobs = Knobs::new(2, Precision::Fp32);
    let mut trainer = Trainer::new(&spec, knobs, &Device::Cpu, 0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    checkpoint::save(&ck, &trainer, &DataSpec::Pattern, 0).unwrap();
    let var = &trainer.model().params().vars()[0];
    let nan = (var.as_tensor() * f64::NAN).unwrap();
    var.set(&nan).unwrap();
    trainer.set_steps(5);
    let err = checkpoint::save(&ck, &trainer, &DataSpec::Pattern, 0).unwrap_err();
    assert!(matches!(err, autotune::Error::NonFinite { .. }), "{err}");
    assert_eq!(latest_step(&ck), 0);
    // A NaN sealed into a checkpoint with a matching manifest, as a bad save elsewhere could.
    let step0 = ck.join("step-000000");
    let model = step0.join("model.safetensors");
    let mut weights = candle_core::safetensors::load(&model, &Device::Cpu).unwrap();
    let (name, t) = weights
        .iter()
        .next()
        .map(|(n, t)| (n.clone(), t.clone()))
        .unwrap();
    weights.insert(name.clone(), (t * f64::NAN).unwrap());
    candle_core::safetensors::save(&weights, &model).unwrap();
    let names = ["model.safetensors", "optimizer.safetensors", "state.json"];
    Manifest::of(&step0, &names).unwrap().write(&step0).unwrap();
    let args = [
        "train",
        "--model",
        "tiny",
        "--micro-batch",
        "2",
        "--data",
        "pattern",
        "--steps",
        "3",
        "--checkpoint-dir",
        "ck",
        "--resume",
        "--seed",
        "0",
    ];
    let out = autotune_in(dir.path(), &args);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("not finite") && err.contains("model.safetensors") && err.contains(&name),
        "{err}"
    );
    assert_eq!(latest_step(&ck), 0, "nothing was saved after it");
}

#[test]
fn run_resumes_its_run_directory_and_refuses_to_replace_it_unasked() {
    let dir = tempfile::tempdir().unwrap();
    let tune = [
        "tune",
        "--model",
        "tiny",
        "--target",
        "cpu",
        "--max-trials",
        "2",
        "--timed-steps",
        "1",
        "--trial-warmup-steps",
        "0",
        "--max-micro-batch",
        "2",
        "--out",
        "r/plan.json",
    ];
    let out = autotune_in(dir.path(), &tune);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // A run stopped before its first checkpoint resumes from its plan.
    let run = [
        "run",
        "--run-dir",
        "r",
        "--data",
        "pattern",
        "--checkpoint-every",
        "1",
    ];
    let out = autotune_in(
        dir.path(),
        &[&run[..], &["--resume", "--steps", "2"]].concat(),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let out = autotune_in(
        dir.path(),
        &[&run[..], &["--resume", "--steps", "3", "--json"]].concat(),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("resuming at step 2"),
        "{}",
        stderr(&out)
    );
    let report: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(report["training"]["steps"], 3);
    let out = autotune_in(dir.path(), &[&run[..], &["--steps", "3"]].concat());
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("already holds a run"),
        "{}",
        stderr(&out)
    );
    assert_eq!(latest_step(&dir.path().join("r/checkpoints")), 3);
    let out = autotune_in(dir.path(), &["run", "--run-dir", "empty", "--resume"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("no plan.json"), "{}", stderr(&out));
}

#[test]
fn the_copy_a_save_takes_owns_its_bytes_on_the_cpu_too() {
    let t = candle_core::Tensor::zeros((4, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
    let copy = checkpoint::host_copy(&t).unwrap();
    let ones = candle_core::Tensor::ones((4, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
    // Writing into the original's storage shows whether the copy shares it.
    t.slice_set(&ones, 0, 0).unwrap();
    let copied: f32 = copy.sum_all().unwrap().to_scalar().unwrap();
    assert_eq!(copied, 0.0, "the copy shares the original's storage");
}

/// Rewrites a checkpoint's state with `edit` and seals it again, as a bad save elsewhere could.
fn reseal_state(step_dir: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let path = step_dir.join("state.json");
    let mut state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut state);
    std::fs::write(&path, state.to_string()).unwrap();
    let names = ["model.safetensors", "optimizer.safetensors", "state.json"];
    Manifest::of(step_dir, &names)
        .unwrap()
        .write(step_dir)
        .unwrap();
}

#[test]
fn counters_at_their_limit_in_a_checkpoint_get_an_answer_not_an_overflow() {
    // Found by the fuzz run: both panicked with "attempt to add with overflow".
    for field in ["step", "clean_steps"] {
        let dir = tempfile::tempdir().unwrap();
        let out = train(dir.path(), "2", &[]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        reseal_state(&dir.path().join("ck/step-000002"), |state| match field {
            "step" => state["step"] = u64::MAX.into(),
            _ => state["scaler"]["clean_steps"] = u64::MAX.into(),
        });
        let out = train(dir.path(), "3", &["--resume"]);
        let code = out.status.code();
        assert!(
            matches!(code, Some(0..=2)),
            "{field}: {code:?} {}",
            stderr(&out)
        );
    }
}

/// Rewrites the header of the safetensors file at `path` with `edit`, keeping its data, as a
/// crafted file would be.
fn rewrite_header(path: &Path, edit: impl Fn(&mut serde_json::Map<String, serde_json::Value>)) {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    edit(&mut header);
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&bytes[8 + len..]);
    std::fs::write(path, out).unwrap();
}

/// The first tensor (by name) of a safetensors header.
fn first_tensor(header: &serde_json::Map<String, serde_json::Value>) -> String {
    header
        .keys()
        .find(|k| *k != "__metadata__")
        .unwrap()
        .clone()
}

/// Seals `step_dir`'s files into its manifest again, as a save elsewhere could have.
fn reseal(step_dir: &Path) {
    let names = ["model.safetensors", "optimizer.safetensors", "state.json"];
    Manifest::of(step_dir, &names)
        .unwrap()
        .write(step_dir)
        .unwrap();
}

/// Edits `step_dir`'s manifest with `edit`.
fn edit_manifest(step_dir: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let path = step_dir.join("manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut manifest);
    std::fs::write(&path, manifest.to_string()).unwrap();
}

/// A checkpoint changed after its save, and what the refusal must name.
struct Tamper {
    what: &'static str,
    edit: fn(&Path),
    names: &'static [&'static str],
    /// Whether `export-weights` reads what was changed (it reads no optimizer state).
    exported: bool,
}

fn tampers() -> Vec<Tamper> {
    vec![
        Tamper {
            what: "a manifest that lists nothing, over a weight of 1e30",
            edit: |d| {
                let weights = d.join("model.safetensors");
                let mut bytes = std::fs::read(&weights).unwrap();
                let at = bytes.len() - 4;
                bytes[at..].copy_from_slice(&1e30f32.to_le_bytes());
                std::fs::write(&weights, bytes).unwrap();
                std::fs::write(d.join("manifest.json"), r#"{"files": []}"#).unwrap();
            },
            names: &["manifest.json", "`files`", "model.safetensors"],
            exported: true,
        },
        Tamper {
            what: "an absolute entry",
            edit: |d| edit_manifest(d, |m| m["files"][0]["name"] = "/dev/zero".into()),
            names: &["manifest.json", "files[0].name", "/dev/zero"],
            exported: true,
        },
        Tamper {
            what: "an entry outside the checkpoint",
            edit: |d| {
                let outside = "../step-000001/model.safetensors";
                edit_manifest(d, |m| m["files"][0]["name"] = outside.into());
            },
            names: &["manifest.json", "files[0].name", "../step-000001"],
            exported: true,
        },
        Tamper {
            what: "a file that is a link to /dev/zero",
            edit: |d| {
                let weights = d.join("model.safetensors");
                std::fs::remove_file(&weights).unwrap();
                std::os::unix::fs::symlink("/dev/zero", &weights).unwrap();
            },
            names: &["model.safetensors", "symbolic link"],
            exported: true,
        },
        Tamper {
            what: "the state of another step",
            edit: |d| {
                reseal_state(d, |state| {
                    state["step"] = 1.into();
                    state["optimizer_steps"] = 1.into();
                })
            },
            names: &["state.json", "`step`", "step-000002"],
            exported: true,
        },
        Tamper {
            what: "a header claiming a tensor far larger than the file",
            edit: |d| {
                rewrite_header(&d.join("model.safetensors"), |h| {
                    let name = first_tensor(h);
                    h[&name]["shape"] = serde_json::json!([1u64 << 40, 1024]);
                });
                reseal(d);
            },
            names: &["model.safetensors", "shape"],
            exported: true,
        },
        Tamper {
            what: "a header giving a parameter no rows",
            edit: |d| {
                rewrite_header(&d.join("model.safetensors"), |h| {
                    let name = first_tensor(h);
                    let start = h[&name]["data_offsets"][0].as_u64().unwrap();
                    h[&name]["shape"] = serde_json::json!([]);
                    h[&name]["data_offsets"] = serde_json::json!([start, start + 4]);
                });
                reseal(d);
            },
            names: &["shape"],
            exported: true,
        },
        Tamper {
            what: "an infinite optimizer moment",
            edit: |d| {
                let moments = d.join("optimizer.safetensors");
                let mut tensors = candle_core::safetensors::load(&moments, &Device::Cpu).unwrap();
                let name = tensors.keys().min().unwrap().clone();
                let inf = (&tensors[&name] + f64::INFINITY).unwrap();
                tensors.insert(name, inf);
                candle_core::safetensors::save(&tensors, &moments).unwrap();
                reseal(d);
            },
            names: &["optimizer.safetensors", "not finite", "tensor `"],
            exported: false,
        },
    ]
}

/// `train` of a small Llama (a model `export-weights` can write) for `steps` steps into `ck`,
/// a checkpoint every step.
fn train_llama(dir: &Path, steps: &str, extra: &[&str]) -> std::process::Output {
    let spec = serde_json::to_string(&crate::util::small_llama(false)).unwrap();
    std::fs::write(dir.join("llama.json"), spec).unwrap();
    let args = [
        "train",
        "--model",
        "llama.json",
        "--micro-batch",
        "2",
        "--data",
        "pattern",
        "--checkpoint-every",
        "1",
        "--checkpoint-dir",
        "ck",
        "--steps",
        steps,
    ];
    crate::inputs::run_bounded(dir, &[&args[..], extra].concat())
}

#[test]
fn a_checkpoint_changed_after_its_save_is_refused_naming_the_file_and_field() {
    for tamper in tampers() {
        let dir = tempfile::tempdir().unwrap();
        let out = train_llama(dir.path(), "2", &[]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let ck = dir.path().join("ck");
        (tamper.edit)(&ck.join("step-000002"));
        let before = crate::inputs::snapshot(dir.path());
        let resume = train_llama(dir.path(), "4", &["--resume"]);
        let export = ["export-weights", "--checkpoint", "ck", "--out", "exported"];
        let mut outcomes = vec![("resume", resume)];
        if tamper.exported {
            outcomes.push(("export", crate::inputs::run_bounded(dir.path(), &export)));
        }
        for (command, out) in outcomes {
            let err = stderr(&out);
            let case = format!("{} ({command}): {err}", tamper.what);
            assert_eq!(out.status.code(), Some(2), "{case}");
            for name in tamper.names {
                assert!(err.contains(name), "{case}: no `{name}`");
            }
        }
        assert_eq!(
            crate::inputs::snapshot(dir.path()),
            before,
            "{}: something was written",
            tamper.what
        );
    }
}

#[test]
fn export_weights_never_writes_into_a_checkpoint_directory_or_its_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let out = train_llama(dir.path(), "2", &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    std::fs::create_dir(dir.path().join("tok")).unwrap();
    std::fs::write(dir.path().join("tok/tokenizer.json"), "{}").unwrap();
    let before = crate::inputs::snapshot(dir.path());
    for (out_dir, checkpoint, input) in [
        ("ck", "ck", "--checkpoint"),
        ("ck/exported", "ck", "--checkpoint"),
        ("ck/step-000002", "ck/step-000002", "--checkpoint"),
        ("ck/new/deeper", "ck/step-000001", "--checkpoint"),
        ("tok", "ck", "--tokenizer"),
    ] {
        let args = [
            "export-weights",
            "--checkpoint",
            checkpoint,
            "--out",
            out_dir,
            "--tokenizer",
            "tok/tokenizer.json",
        ];
        let out = autotune_in(dir.path(), &args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{out_dir}: {err}");
        assert!(
            err.contains(&format!("--out {out_dir}"))
                && err.contains(&format!("which {input} reads")),
            "{out_dir}: {err}"
        );
        assert_eq!(crate::inputs::snapshot(dir.path()), before, "{out_dir}");
    }
    // Beside the checkpoints it is written.
    let out = autotune_in(
        dir.path(),
        &["export-weights", "--checkpoint", "ck", "--out", "exported"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}
