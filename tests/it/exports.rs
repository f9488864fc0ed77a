//! `autotune export` through the binary: a plan from autotune's engine is refused for a
//! PyTorch tool unless the user accepts the mismatch; every document is what its tool loads,
//! with the notes on stderr.

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::Value;

use crate::util::{autotune_in, stderr, stdout};

/// A plan replayed from the committed seed recording, with its provenance.
fn replayed_plan(dir: &Path) -> PathBuf {
    replayed(dir, "seed.json")
}

/// `autotune export --plan PLAN --format FORMAT FLAGS…` in `dir`.
fn export(dir: &Path, plan: &str, format: &str, flags: &[&str]) -> Output {
    let mut args = vec!["export", "--plan", plan, "--format", format];
    args.extend_from_slice(flags);
    autotune_in(dir, &args)
}

/// The plan a replay of the committed recording `name` makes.
fn replayed(dir: &Path, name: &str) -> PathBuf {
    let recording = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("profiles/recorded/rtx4090-32g-on-h200")
        .join(name);
    let path = dir.join("plan.json");
    let backend = format!("replay:{}", recording.display());
    let out = autotune_in(
        dir,
        &[
            "tune",
            "--backend",
            &backend,
            "--out",
            path.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    path
}

#[test]
fn a_plan_from_our_engine_is_refused_for_pytorch_tools_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let plan = replayed_plan(dir.path());
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    assert_eq!(doc["provenance"]["engine"], "autotune");
    assert_eq!(doc["provenance"]["backend"], "replay");
    assert_eq!(doc["provenance"]["device"], "NVIDIA H200");
    let plan = plan.to_str().unwrap();
    for format in ["deepspeed", "trainer", "accelerate", "lightning"] {
        let out = export(dir.path(), plan, format, &[]);
        assert_eq!(out.status.code(), Some(2), "{format}");
        let err = stderr(&out);
        assert!(
            err.contains("provenance.engine") && err.contains("--allow-engine-mismatch"),
            "{err}"
        );
        assert!(err.contains("plan.json"), "names the file: {err}");
        assert!(
            stdout(&out).is_empty(),
            "nothing on stdout: {}",
            stdout(&out)
        );
    }
}

#[test]
fn allowed_exports_print_only_the_document_and_put_notes_on_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let plan = replayed_plan(dir.path());
    let plan = plan.to_str().unwrap();
    let exported = |format: &str| {
        let out = export(dir.path(), plan, format, &["--allow-engine-mismatch"]);
        assert_eq!(out.status.code(), Some(0), "{format}: {}", stderr(&out));
        (stdout(&out), stderr(&out))
    };
    let (ds, err) = exported("deepspeed");
    let ds: Value = serde_json::from_str(&ds).expect("one JSON document");
    assert_eq!(
        ds["gradient_clipping"], 0.0,
        "DeepSpeed's 1.0 default is overridden"
    );
    assert!(ds["optimizer"]["params"]["lr"].as_f64().unwrap() > 0.0);
    assert!(
        err.contains("--allow-engine-mismatch"),
        "the mismatch is still said: {err}"
    );
    let (trainer, _) = exported("trainer");
    let trainer: Value = serde_json::from_str(&trainer).unwrap();
    assert!(trainer.get("warnings").is_none() && trainer.get("mixed_precision").is_none());
    assert!(trainer["per_device_train_batch_size"].as_u64().unwrap() >= 1);
    let (yaml, _) = exported("accelerate");
    assert!(
        yaml.starts_with("compute_environment: LOCAL_MACHINE\n"),
        "{yaml}"
    );
    assert!(!yaml.contains("warning"), "{yaml}");
    let (lightning, err) = exported("lightning");
    let lightning: Value = serde_json::from_str(&lightning).unwrap();
    assert!(lightning["precision"].as_str().unwrap().ends_with("-mixed"));
    assert!(
        err.contains("note: set the DataLoader's batch_size"),
        "{err}"
    );
}

#[test]
fn a_compact_state_plan_is_refused_unless_the_changes_are_accepted_and_then_stated() {
    let dir = tempfile::tempdir().unwrap();
    let plan = replayed(dir.path(), "llama-3.1-8b.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    assert_eq!(doc["knobs"]["state"]["moments"], "int8_blockwise");
    let plan = plan.to_str().unwrap();
    for format in ["deepspeed", "trainer", "accelerate", "lightning"] {
        let out = export(dir.path(), plan, format, &["--allow-engine-mismatch"]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{format}: {err}");
        assert!(err.contains("--allow-lossy-export"), "{format}: {err}");
        assert!(
            err.contains("no update in the backward pass"),
            "{format}: {err}"
        );
        assert!(err.contains("GiB more GPU memory"), "{format}: {err}");
        assert!(stdout(&out).is_empty());
        let allowed = ["--allow-engine-mismatch", "--allow-lossy-export"];
        let out = export(dir.path(), plan, format, &allowed);
        let (text, err) = (stdout(&out), stderr(&out));
        assert_eq!(out.status.code(), Some(0), "{format}: {err}");
        assert!(
            err.contains("exporting anyway (--allow-lossy-export)"),
            "{err}"
        );
        match format {
            "trainer" => {
                let args: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(
                    args["optim"], "paged_adamw_8bit",
                    "bitsandbytes' paged 8-bit AdamW"
                );
            }
            "accelerate" => assert!(
                text.starts_with("# autotune: exported with changes"),
                "{text}"
            ),
            _ => {
                serde_json::from_str::<Value>(&text).expect("the document stays JSON");
            }
        }
    }
}

#[test]
fn an_fp8_plan_exports_through_transformer_engine_or_is_refused_where_a_tool_has_no_fp8() {
    let dir = tempfile::tempdir().unwrap();
    let plan = replayed_plan(dir.path());
    let mut doc: Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    doc["knobs"]["precision"] = "fp8".into();
    std::fs::write(&plan, doc.to_string()).unwrap();
    let plan = plan.to_str().unwrap();
    let exported = |format: &str, lossy: bool| {
        let flags: &[&str] = if lossy {
            &["--allow-engine-mismatch", "--allow-lossy-export"]
        } else {
            &["--allow-engine-mismatch"]
        };
        export(dir.path(), plan, format, flags)
    };
    let out = exported("accelerate", false);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("mixed_precision: fp8\n"),
        "{}",
        stdout(&out)
    );
    assert!(
        stderr(&out).contains("Transformer Engine"),
        "{}",
        stderr(&out)
    );
    let out = exported("lightning", false);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let args: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(args["precision"], "transformer-engine");
    for format in ["trainer", "deepspeed"] {
        let out = exported(format, false);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{format}: {err}");
        assert!(err.contains("no fp8 matrix products"), "{format}: {err}");
        assert!(err.contains("--allow-fp8"), "{format}: {err}");
        let out = exported(format, true);
        assert_eq!(out.status.code(), Some(0), "{format}: {}", stderr(&out));
        let text: Value = serde_json::from_str(&stdout(&out)).unwrap();
        let bf16 = match format {
            "trainer" => text["bf16"].clone(),
            _ => text["bf16"]["enabled"].clone(),
        };
        assert_eq!(bf16, true, "{format} trains the fp8 plan in bf16");
    }
}
