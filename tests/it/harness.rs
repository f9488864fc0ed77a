//! The PyTorch harness (`harness/autotune_harness`) as a trial runner on the CPU, when a Python
//! with torch is at hand (`AUTOTUNE_TEST_PYTHON`, else `python3`); skipped, saying so, where
//! none is; its protocol side is tested with the standard library alone, everywhere. The fake
//! runner's tests (`exec.rs`) run everywhere too.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::util::{autotune_in, stderr, stdout};

/// A Python that imports torch, or `None` (the test is then skipped).
fn torch_python() -> Option<String> {
    let python = std::env::var("AUTOTUNE_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", "import torch"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: `{python}` cannot import torch (set AUTOTUNE_TEST_PYTHON)");
    }
    ok.then_some(python)
}

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("harness/examples")
        .join(name)
}

fn tune(dir: &Path, python: &str, device: &str, flags: &[&str]) -> std::process::Output {
    let runner = example("gpt_runner.py");
    let mut args = vec![
        "tune",
        "--model",
        "tiny",
        "--target",
        device,
        "--backend",
        "exec",
        "--max-micro-batch",
        "8",
        "--trial-warmup-steps",
        "1",
        "--timed-steps",
        "2",
    ];
    args.extend_from_slice(flags);
    args.extend(["--", python, runner.to_str().unwrap()]);
    autotune_in(dir, &args)
}

#[test]
fn the_harness_tunes_a_small_gpt_in_pytorch_on_the_cpu() {
    let Some(python) = torch_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = tune(
        dir.path(),
        &python,
        "cpu",
        &[
            "--checkpointing",
            "none",
            "--checkpointing",
            "all",
            "--out",
            "plan.json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let plan: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("plan.json")).unwrap())
            .unwrap();
    assert_eq!(plan["provenance"]["engine"], "pytorch");
    assert_eq!(plan["provenance"]["backend"], "exec");
    assert!(plan["provenance"]["engine_version"].is_string());
    let fits: Vec<&Value> = plan["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["outcome"] == "fits")
        .collect();
    assert!(fits.len() >= 3, "{}", stderr(&out));
    for trial in fits {
        assert_eq!(trial["peak_gpu_bytes"], 0, "no device memory on the CPU");
        assert!(trial["peak_host_bytes"].as_u64().unwrap() > 10 << 20);
        assert!(trial["step_time_median_s"].as_f64().unwrap() > 0.0);
    }
    let export = autotune_in(
        dir.path(),
        &["export", "--plan", "plan.json", "--format", "trainer"],
    );
    assert_eq!(export.status.code(), Some(0), "{}", stderr(&export));
    let args: Value = serde_json::from_str(&stdout(&export)).unwrap();
    assert_eq!(
        args["per_device_train_batch_size"],
        plan["knobs"]["micro_batch"]
    );
}

#[test]
fn a_host_smaller_than_pytorch_itself_is_out_of_host_memory() {
    let Some(python) = torch_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // Python with torch alone holds more than 64 MiB resident.
    let device = dir.path().join("small-host.json");
    std::fs::write(
        &device,
        r#"{"name": "small-host", "kind": "cpu", "gpu_memory_bytes": null, "host_memory_bytes": 67108864}"#,
    )
    .unwrap();
    let out = tune(
        dir.path(),
        &python,
        device.to_str().unwrap(),
        &["--checkpointing", "none", "--json"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let answer: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let evidence = answer["evidence"].as_array().unwrap();
    assert!(!evidence.is_empty());
    assert!(
        evidence
            .iter()
            .all(|t| t["outcome"] == "out_of_memory" && t["memory"] == "host"),
        "{evidence:?}"
    );
}

/// The harness's protocol side, with the standard library alone: runs everywhere.
#[test]
fn the_harness_reads_requests_and_writes_replies_without_torch() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("python3")
        .current_dir(root)
        .args(["-B", "-m", "unittest", "discover", "-s", "harness/tests"])
        .output()
        .expect("python3 runs");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("Ran 3 tests"), "{text}");
}
