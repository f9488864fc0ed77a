use crate::util::{autotune, autotune_in, stderr};

#[test]
fn missing_data_file_exits_2_naming_the_file() {
    let out = autotune(&[
        "train",
        "--model",
        "tiny",
        "--steps",
        "1",
        "--data",
        "/nonexistent/corpus.txt",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("/nonexistent/corpus.txt"), "{err}");
}

#[test]
fn impossible_spec_exits_2_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("bad.json"),
        r#"{"preset": "tiny", "n_heads": 3}"#,
    )
    .unwrap();
    let out = autotune_in(
        dir.path(),
        &["train", "--model", "bad.json", "--steps", "1"],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("bad.json") && err.contains("n_heads"), "{err}");
}

#[test]
fn corrupt_checkpoint_exits_2_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let args = [
        "train",
        "--model",
        "tiny",
        "--steps",
        "2",
        "--micro-batch",
        "2",
        "--data",
        "pattern",
        "--checkpoint-dir",
    ];
    let out = autotune_in(dir.path(), &[&args[..], &["ckpt"]].concat());
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let weights = ckpt.join("step-000002").join("model.safetensors");
    assert!(weights.exists());
    std::fs::write(&weights, b"not a safetensors file").unwrap();
    let out = autotune_in(dir.path(), &[&args[..], &["ckpt", "--resume"]].concat());
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn resume_continues_and_reports_json() {
    let dir = tempfile::tempdir().unwrap();
    let base = [
        "train",
        "--model",
        "tiny",
        "--micro-batch",
        "2",
        "--data",
        "pattern",
        "--checkpoint-dir",
        "ck",
        "--json",
    ];
    let out = autotune_in(dir.path(), &[&base[..], &["--steps", "2"]].concat());
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let out = autotune_in(
        dir.path(),
        &[&base[..], &["--steps", "4", "--resume"]].concat(),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON document");
    assert_eq!(report["steps"], 4);
    assert!(stderr(&out).contains("resuming at step 2"));
    // Changing the knobs on resume is refused rather than silently mixing runs.
    let out = autotune_in(
        dir.path(),
        &[
            &base[..],
            &["--steps", "6", "--resume", "--precision", "bf16"],
        ]
        .concat(),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("pass the same knobs"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn bad_flag_values_exit_2() {
    let out = autotune(&["train", "--precision", "fp4"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("fp4"));
    let out = autotune(&["train", "--micro-batch", "0", "--steps", "1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("`--micro-batch`"), "{}", stderr(&out));
}

/// `--version` names the build's device support and the candle it trains with, and that
/// candle is the one the lock file resolves (the constant is kept by hand).
#[test]
fn the_version_line_names_the_build_and_the_locked_candle() {
    let out = autotune(&["--version"]);
    assert_eq!(out.status.code(), Some(0));
    let line = crate::util::stdout(&out);
    let build = if cfg!(feature = "nccl") {
        "CUDA + NCCL build"
    } else if cfg!(feature = "cuda") {
        "CUDA build"
    } else {
        "CPU-only build"
    };
    assert!(
        line.starts_with(&format!("autotune {}", env!("CARGO_PKG_VERSION"))),
        "{line}"
    );
    assert!(line.contains(build), "{line}");
    let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.lock")).unwrap();
    let locked = lock
        .split("[[package]]")
        .find(|p| p.contains("name = \"candle-core\""))
        .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = ")))
        .map(|v| v.trim_matches('"').to_string())
        .expect("candle-core in Cargo.lock");
    assert_eq!(locked, autotune::backend::CANDLE_VERSION);
    assert!(line.contains(&format!("candle {locked}")), "{line}");
}

#[test]
fn device_reports_the_build_and_the_host_memory() {
    let out = autotune(&["device", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let machine: serde_json::Value = serde_json::from_str(&crate::util::stdout(&out)).unwrap();
    let total = machine["host"]["total_bytes"].as_u64().unwrap();
    let available = machine["host"]["available_bytes"].as_u64().unwrap();
    assert!(total > 0 && available <= total, "{machine}");
    if cfg!(feature = "cuda") {
        assert_ne!(machine["build"], "cpu");
    } else {
        assert_eq!(machine["build"], "cpu");
        assert_eq!(machine["gpus"], serde_json::json!([]));
        let note = machine["note"].as_str().unwrap();
        assert!(note.contains("no GPU support"), "{note}");
    }
    let text = autotune(&["device"]);
    let text = crate::util::stdout(&text);
    assert!(text.contains("host memory:"), "{text}");
}

#[test]
fn completions_cover_every_command_and_parse_in_bash() {
    let out = autotune(&["completions", "bash"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let script = crate::util::stdout(&out);
    for command in [
        "run",
        "tune",
        "export",
        "check",
        "estimate",
        "device",
        "train",
        "probe",
        "completions",
    ] {
        assert!(
            script.contains(command),
            "bash completions lack `{command}`"
        );
    }
    assert!(script.contains("--lr-schedule") && script.contains("--metrics"));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("autotune.bash");
    std::fs::write(&path, &script).unwrap();
    if let Ok(check) = std::process::Command::new("bash")
        .arg("-n")
        .arg(&path)
        .output()
    {
        assert!(
            check.status.success(),
            "{}",
            String::from_utf8_lossy(&check.stderr)
        );
    }
    for shell in ["zsh", "fish", "powershell", "elvish"] {
        let out = autotune(&["completions", shell]);
        assert_eq!(out.status.code(), Some(0), "{shell}");
        assert!(crate::util::stdout(&out).contains("estimate"), "{shell}");
    }
    assert_eq!(autotune(&["completions", "tcsh"]).status.code(), Some(2));
}

#[test]
fn renamed_flags_keep_working_under_their_old_names_and_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let tune = |names: [&str; 2]| {
        autotune_in(
            dir.path(),
            &[
                "tune",
                "--model",
                "tiny",
                names[0],
                "cpu",
                names[1],
                "0",
                "--timed-steps",
                "1",
                "--max-trials",
                "1",
                "--json",
            ],
        )
    };
    let old = tune(["--device", "--warmup-steps"]);
    let new = tune(["--target", "--trial-warmup-steps"]);
    assert_eq!(old.status.code(), Some(0), "{}", stderr(&old));
    assert_eq!(new.status.code(), Some(0), "{}", stderr(&new));
    let (old_err, new_err) = (stderr(&old), stderr(&new));
    for note in [
        "`--device` is now `--target`",
        "`--warmup-steps` is now `--trial-warmup-steps`",
    ] {
        assert!(old_err.contains(note), "{old_err}");
        assert!(!new_err.contains(note), "{new_err}");
    }
    let plan = |out: &std::process::Output| -> serde_json::Value {
        let mut plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        plan["knobs"].take()
    };
    assert_eq!(plan(&old), plan(&new), "both names mean the same search");
    let train = autotune_in(
        dir.path(),
        &["train", "--steps", "1", "--warmup-steps", "1", "--json"],
    );
    assert_eq!(train.status.code(), Some(0), "{}", stderr(&train));
    assert!(
        stderr(&train).contains("`--warmup-steps` is now `--lr-warmup-steps`"),
        "{}",
        stderr(&train)
    );
}

#[test]
fn an_output_over_an_input_another_output_or_a_device_is_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("d.bin"), [1u8, 0, 2, 0, 3, 0]).unwrap();
    std::fs::write(dir.path().join("plan.json"), "{}").unwrap();
    let cases: [(&[&str], &str); 4] = [
        (
            &[
                "tune", "--target", "cpu", "--out", "p.json", "--report", "./p.json",
            ],
            "--out's output",
        ),
        (
            &[
                "train",
                "--device",
                "cpu",
                "--data",
                "d.bin",
                "--metrics",
                "d.bin",
            ],
            "the file --data reads",
        ),
        (
            &["report", "plan.json", "--out", "plan.json"],
            "`autotune report` reads",
        ),
        (
            &["tune", "--target", "cpu", "--out", "/dev/null"],
            "not a regular file",
        ),
    ];
    for (args, says) in cases {
        let out = autotune_in(dir.path(), args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // Nothing was written, and the inputs are whole.
    assert_eq!(
        std::fs::read(dir.path().join("d.bin")).unwrap(),
        [1, 0, 2, 0, 3, 0]
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("plan.json")).unwrap(),
        "{}"
    );
    assert!(!dir.path().join("p.json").exists());
}

#[test]
fn an_output_through_a_symbolic_link_is_refused_or_written_to_its_target_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("plans")).unwrap();
    std::fs::write(d.join("plans/plan.json"), "old").unwrap();
    std::os::unix::fs::symlink("plans/plan.json", d.join("latest.json")).unwrap();
    std::os::unix::fs::symlink("plans/missing/none.json", d.join("dangling.json")).unwrap();
    let tune = |extra: &[&str]| {
        let mut args = vec![
            "tune",
            "--model",
            "tiny",
            "--target",
            "cpu",
            "--max-trials",
            "1",
            "--timed-steps",
            "1",
            "--edge-trials",
            "0",
        ];
        args.extend_from_slice(extra);
        autotune_in(d, &args)
    };
    // Refused by default, naming the flag and the way to write through it; nothing written.
    let refused = tune(&["--out", "latest.json"]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(stderr(&refused).contains("--out latest.json"));
    assert!(stderr(&refused).contains("--follow-symlinks"));
    assert_eq!(
        std::fs::read_to_string(d.join("plans/plan.json")).unwrap(),
        "old"
    );
    // Followed when asked: the target holds the plan and the link is still a link to it.
    let followed = tune(&["--out", "latest.json", "--follow-symlinks"]);
    assert_eq!(followed.status.code(), Some(0), "{}", stderr(&followed));
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("plans/plan.json")).unwrap()).unwrap();
    assert_eq!(plan["tool"]["name"], "autotune");
    assert!(std::fs::symlink_metadata(d.join("latest.json"))
        .unwrap()
        .file_type()
        .is_symlink());
    // A link to nothing has no target to write.
    let dangling = tune(&["--out", "dangling.json", "--follow-symlinks"]);
    assert_eq!(dangling.status.code(), Some(2), "{}", stderr(&dangling));
    assert!(stderr(&dangling).contains("--out dangling.json"));
    assert!(!d.join("plans/missing").exists());
}
