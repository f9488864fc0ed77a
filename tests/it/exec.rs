//! The exec backend through a fake trial runner (`tests/fixtures/exec/fake_runner.py`, Python 3
//! standard library): every way a runner can fail is an outcome, a search through failures
//! still finds the known boundary, the plan records the runner's engine (so its exports need
//! no override), and a recording of it replays and re-checks.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use autotune::knobs::{Checkpointing, Knobs, Offload, Precision};
use autotune::probe::exec::ExecProber;
use autotune::probe::job::{TrialProcesses, TrialSetup};
use autotune::probe::runner::RunnerCommand;
use autotune::probe::timeout::TrialTimeout;
use autotune::trial::{MemoryKind, Outcome, Prober, TrialRequest};
use autotune::ModelSpec;

use crate::util::{autotune_in, stderr, stdout};

const MIB: u64 = 1 << 20;

pub(crate) fn fake_runner() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/exec/fake_runner.py")
}

/// The fake runner's command line with `args`.
pub(crate) fn runner_argv(args: &[&str]) -> Vec<String> {
    let mut argv = vec![
        "python3".to_string(),
        fake_runner().to_string_lossy().into_owned(),
    ];
    argv.extend(args.iter().map(|a| a.to_string()));
    argv
}

/// A prober asking the fake runner, on a 4 GiB GPU target, each trial limited to 5 s.
pub(crate) fn prober(args: &[&str]) -> ExecProber {
    let setup = TrialSetup::new(&ModelSpec::tiny(), "cuda", Some(4 << 30), Some(32 << 30));
    let command = RunnerCommand::new(&runner_argv(args)).unwrap();
    ExecProber::new(
        TrialProcesses::new(command, setup)
            .with_timeout(TrialTimeout::fixed(Duration::from_secs(5))),
    )
}

pub(crate) fn request(micro_batch: usize) -> TrialRequest {
    request_of(Knobs::new(micro_batch, Precision::Bf16))
}

fn request_of(knobs: Knobs) -> TrialRequest {
    TrialRequest {
        knobs,
        warmup_steps: 1,
        timed_steps: 3,
        remeasure: false,
    }
}

pub(crate) fn crash_reason(outcome: &Outcome) -> &str {
    match outcome {
        Outcome::Crashed { reason } => reason,
        other => panic!("expected a crash, got {other:?}"),
    }
}

/// The micro-batches and pids of the trials the fake runner logged.
fn logged(log: &Path) -> Vec<(u64, usize)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (
                v["pid"].as_u64().unwrap(),
                v["micro_batch"].as_u64().unwrap() as usize,
            )
        })
        .collect()
}

/// Whether process `pid` is gone (or a zombie about to be reaped).
pub(crate) fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

pub(crate) fn wait_gone(pid: u32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if gone(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

#[test]
fn every_way_a_runner_fails_is_an_outcome_of_its_trial() {
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    let pid_file = pids.to_str().unwrap();
    let mut exec = prober(&[
        "--at",
        "2:crash",
        "--at",
        "3:garbage",
        "--at",
        "4:hang",
        "--at",
        "5:invalid",
        "--at",
        "6:oom",
        "--at",
        "7:sigkill",
        "--at",
        "8:silent",
        "--at",
        "9:cuda-oom-words",
        "--at",
        "10:error",
        "--pid-file",
        pid_file,
    ]);
    let mut run = |mb: usize| exec.probe(&request(mb)).expect("a trial is an outcome");

    let fits = run(1);
    let Outcome::Fits(m) = &fits.outcome else {
        panic!("{fits:?}");
    };
    // 1024 + 100 MiB at micro-batch 1; tokens/s from the median of 0.11 s and tiny's 64 tokens.
    assert_eq!(m.peak_gpu_bytes, 1124 * MIB);
    assert_eq!(m.timed_steps, 3);
    assert!(
        (m.tokens_per_s - 64.0 / 0.11).abs() < 1e-6,
        "{}",
        m.tokens_per_s
    );

    let crashed = run(2);
    assert!(
        crash_reason(&crashed.outcome).contains("crashed on purpose"),
        "{crashed:?}"
    );

    let garbage = run(3);
    let reason = crash_reason(&garbage.outcome);
    assert!(
        reason.contains("without a reply") && reason.contains("binary"),
        "{reason}"
    );

    let started = Instant::now();
    let hung = run(4);
    assert_eq!(hung.outcome, Outcome::TimedOut { after_s: 5.0 });
    assert!(started.elapsed() < Duration::from_secs(15));
    let text = std::fs::read_to_string(&pids).unwrap();
    for pid in text.split_whitespace() {
        let pid: u32 = pid.parse().unwrap();
        assert!(
            wait_gone(pid),
            "process {pid} of the hung trial was stopped with it"
        );
    }

    let invalid = run(5);
    let reason = crash_reason(&invalid.outcome);
    assert!(
        reason.contains("step_times_s[0]"),
        "names the field: {reason}"
    );

    for (mb, memory) in [
        (6, MemoryKind::Gpu),
        (7, MemoryKind::Host),
        (9, MemoryKind::Gpu),
    ] {
        let result = run(mb);
        assert!(
            matches!(result.outcome, Outcome::OutOfMemory { memory: m, .. } if m == memory),
            "{mb}: {result:?}"
        );
    }

    let silent = run(8);
    assert!(
        crash_reason(&silent.outcome).contains("exit status: 3"),
        "{silent:?}"
    );

    let error = run(10);
    assert_eq!(
        crash_reason(&error.outcome),
        "trial runner: the fake runner failed this trial"
    );
    // After all that, the runner still measures.
    assert!(matches!(run(11).outcome, Outcome::Fits(_)));
    assert_eq!(exec.identity().unwrap().engine, "fake-torch");
    assert_eq!(exec.identity().unwrap().device.as_deref(), Some("fake GPU"));
}

#[test]
fn a_runner_that_serves_is_reused_until_a_trial_fails_and_fresh_runs_start_one_each() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let log_arg = log.to_str().unwrap();
    let mut exec = prober(&["--serve", "--at", "3:error", "--log", log_arg]);
    for mb in 1..=5 {
        exec.probe(&request(mb)).unwrap();
    }
    let trials = logged(&log);
    assert_eq!(
        trials.iter().map(|t| t.1).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5]
    );
    let pid = |i: usize| trials[i].0;
    assert_eq!(
        (pid(0), pid(1)),
        (pid(0), pid(2)),
        "one process served 1 to 3"
    );
    assert_ne!(pid(3), pid(2), "a new runner after the failed trial");
    assert_eq!(pid(3), pid(4));
    assert_eq!(exec.runners_started(), 2);

    std::fs::remove_file(&log).unwrap();
    let mut fresh = prober(&["--serve", "--log", log_arg]).fresh_per_trial(true);
    for mb in 1..=3 {
        assert!(matches!(
            fresh.probe(&request(mb)).unwrap().outcome,
            Outcome::Fits(_)
        ));
    }
    let trials = logged(&log);
    assert_eq!(trials.len(), 3);
    assert!(trials[0].0 != trials[1].0 && trials[1].0 != trials[2].0);
    assert_eq!(fresh.runners_started(), 3);
}

#[test]
fn an_unsupported_regime_is_answered_without_asking_again() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let mut exec = prober(&["--offload", "unsupported", "--log", log.to_str().unwrap()]);
    let offloaded = |mb| Knobs {
        offload: Offload::Optimizer,
        ..Knobs::new(mb, Precision::Bf16)
    };
    for mb in [8, 4, 2] {
        let result = exec.probe(&request_of(offloaded(mb))).unwrap();
        let reason = crash_reason(&result.outcome);
        assert!(
            reason.contains("offload=optimizer") && reason.contains("lacks"),
            "{reason}"
        );
    }
    let checkpointed = Knobs {
        checkpointing: Checkpointing::EveryKth(1),
        ..Knobs::new(8, Precision::Bf16)
    };
    assert!(matches!(
        exec.probe(&request_of(checkpointed)).unwrap().outcome,
        Outcome::Fits(_)
    ));
    let asked: Vec<usize> = logged(&log).iter().map(|t| t.1).collect();
    assert_eq!(asked, [8, 8], "the offloaded regime was asked once");
}

#[test]
fn another_protocol_version_or_a_change_of_engine_is_an_error() {
    let mut newer = prober(&["--protocol", "3"]);
    let err = newer.probe(&request(1)).unwrap_err().to_string();
    assert!(err.contains("protocol") && err.contains("is 3"), "{err}");

    let mut switching = prober(&["--engine-at", "2:jax"]);
    assert!(switching.probe(&request(1)).is_ok());
    let err = switching.probe(&request(2)).unwrap_err().to_string();
    assert!(
        err.contains("\"jax\"") && err.contains("fake-torch"),
        "{err}"
    );

    let mut expected = prober(&[]).expecting_engine("pytorch");
    let err = expected.probe(&request(1)).unwrap_err().to_string();
    assert!(err.contains("the recording"), "{err}");

    let mut missing = ExecProber::new(TrialProcesses::new(
        RunnerCommand::new(&["./no-such-runner".to_string()]).unwrap(),
        TrialSetup::new(&ModelSpec::tiny(), "cpu", None, Some(1 << 30)),
    ));
    let err = missing.probe(&request(1)).unwrap_err().to_string();
    assert!(err.contains("no-such-runner"), "{err}");
}

/// A 4 GiB GPU target with a 32 GiB host, as a device spec file.
pub(crate) fn device_file(dir: &Path) -> PathBuf {
    let path = dir.join("card.json");
    let spec = serde_json::json!({
        "name": "fake-4g", "kind": "cuda", "gpu_memory_bytes": 4u64 << 30,
        "host_memory_bytes": 32u64 << 30
    });
    std::fs::write(&path, spec.to_string()).unwrap();
    path
}

/// `tune --backend exec` of tiny on the fake 4 GiB card through the fake runner with `runner`.
pub(crate) fn tune(dir: &Path, flags: &[&str], runner: &[&str]) -> std::process::Output {
    let device = device_file(dir);
    let mut args = vec![
        "tune",
        "--model",
        "tiny",
        "--target",
        device.to_str().unwrap(),
        "--backend",
        "exec",
        "--precision",
        "bf16",
        "--max-micro-batch",
        "64",
        "--trial-timeout",
        "5",
    ];
    args.extend_from_slice(flags);
    args.push("--");
    let argv = runner_argv(runner);
    args.extend(argv.iter().map(String::as_str));
    autotune_in(dir, &args)
}

#[test]
fn a_search_through_a_failing_runner_finds_the_known_boundary() {
    let dir = tempfile::tempdir().unwrap();
    // Memory 1024 + 100·mb MiB against 4 GiB with 5 % headroom: 28 is the largest feasible
    // micro-batch (29 and 30 fit only inside the headroom, 31 and up run out of memory).
    // Above the card trials fail in turn every way a runner can (micro-batch 64, the first
    // trial here, hangs), and micro-batch 16 is slow.
    let runner = [
        "--over", "mixed", "--at", "64:hang", "--at", "16:slow", "--serve",
    ];
    let out = tune(
        dir.path(),
        &["--checkpointing", "none", "--offload", "none", "--json"],
        &runner,
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let plan: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(plan["knobs"]["micro_batch"], 28, "{}", stderr(&out));
    assert_eq!(plan["provenance"]["engine"], "fake-torch");
    assert_eq!(plan["provenance"]["engine_version"], "0.0-test");
    assert_eq!(plan["provenance"]["backend"], "exec");
    assert_eq!(plan["provenance"]["device"], "fake GPU");
    assert!(plan["provenance"].get("candle_version").is_none());
    assert_eq!(plan["measured"]["peak_gpu_bytes"], (1024 + 2800) * MIB);
    let evidence = plan["evidence"].as_array().unwrap();
    assert!(
        evidence.iter().any(|t| t["outcome"] != "fits"),
        "the search met the failures"
    );
    assert!(evidence
        .iter()
        .filter(|t| t["outcome"] == "fits")
        .all(|t| t["request"]["knobs"]["micro_batch"].as_u64().unwrap() <= 30));
    let err = stderr(&out);
    assert!(err.contains("through the trial runner `python3 "), "{err}");

    // Recorded (without the hang: a check has no time limit for the trial that hung), the
    // search replays to the same plan, measured by the same engine.
    let runner = ["--over", "mixed", "--serve"];
    let recorded = tune(
        dir.path(),
        &[
            "--checkpointing",
            "none",
            "--offload",
            "none",
            "--json",
            "--record",
            "profile.json",
        ],
        &runner,
    );
    assert_eq!(recorded.status.code(), Some(0), "{}", stderr(&recorded));
    let plan: Value = serde_json::from_str(&stdout(&recorded)).unwrap();
    assert_eq!(plan["knobs"]["micro_batch"], 28, "{}", stderr(&recorded));
    let profile: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("profile.json")).unwrap())
            .unwrap();
    assert_eq!(profile["engine"], "fake-torch");
    assert_eq!(profile["device"]["name"], "fake GPU");
    let replayed = autotune_in(
        dir.path(),
        &["tune", "--backend", "replay:profile.json", "--json"],
    );
    assert_eq!(replayed.status.code(), Some(0), "{}", stderr(&replayed));
    let again: Value = serde_json::from_str(&stdout(&replayed)).unwrap();
    assert_eq!(again["knobs"], plan["knobs"]);
    assert_eq!(again["provenance"]["engine"], "fake-torch");
    assert_eq!(again["provenance"]["backend"], "replay");

    // Re-measured through the runner, the recording checks out; autotune's engine refuses it.
    let runner = runner_argv(&runner);
    let mut args = vec![
        "check",
        "--profile",
        "profile.json",
        "--backend",
        "exec",
        "--",
    ];
    args.extend(runner.iter().map(String::as_str));
    let checked = autotune_in(dir.path(), &args);
    assert_eq!(checked.status.code(), Some(0), "{}", stderr(&checked));
    let refused = autotune_in(dir.path(), &["check", "--profile", "profile.json"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        stderr(&refused).contains("--backend exec"),
        "{}",
        stderr(&refused)
    );
}

#[test]
fn a_plan_measured_by_a_pytorch_runner_exports_without_an_override() {
    let dir = tempfile::tempdir().unwrap();
    let out = tune(
        dir.path(),
        &["--out", "plan.json"],
        &["--engine", "pytorch", "--offload", "unsupported", "--serve"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    for format in ["deepspeed", "trainer", "accelerate", "lightning"] {
        let export = autotune_in(
            dir.path(),
            &["export", "--plan", "plan.json", "--format", format],
        );
        assert_eq!(
            export.status.code(),
            Some(0),
            "{format}: {}",
            stderr(&export)
        );
        assert!(!stderr(&export).contains("allow-engine-mismatch"));
    }
    let plan: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("plan.json")).unwrap())
            .unwrap();
    // Offload was unsupported: its regimes failed, the plan is one the runner could run.
    assert_eq!(plan["knobs"]["offload"], "none");
    assert!(plan["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["reason"]
            .as_str()
            .is_some_and(|r| r.contains("cannot run"))));
    // A runner of another engine makes a plan that PyTorch's tools refuse by default.
    let other = tune(
        dir.path(),
        &["--out", "other.json"],
        &["--offload", "unsupported", "--serve"],
    );
    assert_eq!(other.status.code(), Some(0), "{}", stderr(&other));
    let export = autotune_in(
        dir.path(),
        &["export", "--plan", "other.json", "--format", "deepspeed"],
    );
    assert_eq!(export.status.code(), Some(2));
}

/// The allocator setting each trial in the fake runner's `log` ran under, in order.
fn allocators_logged(log: &Path) -> Vec<Option<String>> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            v["allocator"].as_str().map(str::to_string)
        })
        .collect()
}

#[test]
fn a_runner_trains_under_expandable_segments_which_the_plan_and_its_exports_carry() {
    const EXPANDABLE: &str = "expandable_segments:True";
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("trials.log");
    // Under PyTorch's default allocator micro-batches 12 to 20 run out of memory (its block
    // splitting); under expandable segments memory follows the law, whose boundary is 28.
    let runner = [
        "--engine",
        "pytorch",
        "--offload",
        "unsupported",
        "--serve",
        "--fragmented",
        "12-20",
        "--log",
        log.to_str().unwrap(),
    ];
    let plain = ["--checkpointing", "none", "--offload", "none"];
    let flags = [
        &plain[..],
        &["--out", "plan.json", "--record", "profile.json"],
    ]
    .concat();
    let out = tune(dir.path(), &flags, &runner);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let read = |name: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(name)).unwrap()).unwrap()
    };
    let plan = read("plan.json");
    assert_eq!(plan["knobs"]["micro_batch"], 28, "{}", stderr(&out));
    assert_eq!(plan["provenance"]["allocator"], EXPANDABLE);
    assert_eq!(read("profile.json")["allocator"], EXPANDABLE);
    let seen = allocators_logged(&log);
    assert!(!seen.is_empty() && seen.iter().all(|a| a.as_deref() == Some(EXPANDABLE)));
    let line = format!("PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}");
    for format in ["deepspeed", "trainer", "accelerate", "lightning"] {
        let export = autotune_in(
            dir.path(),
            &["export", "--plan", "plan.json", "--format", format],
        );
        assert_eq!(export.status.code(), Some(0), "{}", stderr(&export));
        assert!(
            stderr(&export).contains(&format!("environment: {line}")),
            "{format}"
        );
        if format == "accelerate" {
            assert!(stdout(&export).starts_with("# autotune: start `accelerate launch`"));
            assert!(stdout(&export).lines().next().unwrap().ends_with(&line));
        }
    }

    // Under PyTorch's default the runner sees no setting, meets the split blocks, and its plan
    // asks for no environment.
    std::fs::remove_file(&log).unwrap();
    let flags = [
        &plain[..],
        &["--allocator", "pytorch-default", "--out", "default.json"],
    ]
    .concat();
    let out = tune(dir.path(), &flags, &runner);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let plan = read("default.json");
    assert_eq!(plan["provenance"]["allocator"], "");
    assert!(allocators_logged(&log).iter().all(Option::is_none));
    assert!(plan["evidence"].as_array().unwrap().iter().any(|t| {
        let mb = t["request"]["knobs"]["micro_batch"].as_u64().unwrap();
        (12..=20).contains(&mb) && t["outcome"] == "out_of_memory"
    }));
    let export = autotune_in(
        dir.path(),
        &["export", "--plan", "default.json", "--format", "trainer"],
    );
    assert!(
        !stderr(&export).contains("PYTORCH_CUDA_ALLOC_CONF"),
        "{}",
        stderr(&export)
    );

    // The user's own setting is kept, and a check runs the runner under the recording's.
    std::fs::remove_file(&log).unwrap();
    let mut args = vec![
        "check",
        "--profile",
        "profile.json",
        "--backend",
        "exec",
        "--",
    ];
    let argv = runner_argv(&runner);
    args.extend(argv.iter().map(String::as_str));
    let checked = crate::util::command()
        .current_dir(dir.path())
        .env("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
        .args(&args)
        .output()
        .unwrap();
    assert_eq!(checked.status.code(), Some(0), "{}", stderr(&checked));
    assert!(allocators_logged(&log)
        .iter()
        .all(|a| a.as_deref() == Some(EXPANDABLE)));
    let own = crate::util::command()
        .current_dir(dir.path())
        .env("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
        .args(["tune", "--backend", "replay:profile.json", "--json"])
        .output()
        .unwrap();
    let replayed: Value = serde_json::from_str(&stdout(&own)).unwrap();
    assert_eq!(
        replayed["provenance"]["allocator"], EXPANDABLE,
        "the recording's"
    );

    // Only a trial runner takes an allocator setting.
    let refused = autotune_in(
        dir.path(),
        &["tune", "--model", "tiny", "--allocator", "pytorch-default"],
    );
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        stderr(&refused).contains("`--allocator`") && stderr(&refused).contains("--backend exec")
    );
}

#[test]
fn a_runner_that_never_answers_well_is_no_feasible_plan() {
    let dir = tempfile::tempdir().unwrap();
    let out = tune(
        dir.path(),
        &[
            "--checkpointing",
            "none",
            "--offload",
            "none",
            "--isolation",
            "child",
        ],
        &["--over", "garbage", "--law", "9000,100"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("no feasible plan"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn exec_flags_that_cannot_work_are_refused_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let device = device_file(dir.path());
    let device = device.to_str().unwrap();
    let argv = runner_argv(&[]);
    let with_runner = |flags: &[&str]| {
        let mut args: Vec<&str> = flags.to_vec();
        args.push("--");
        args.extend(argv.iter().map(String::as_str));
        autotune_in(dir.path(), &args)
    };
    let cases: [(Vec<&str>, &str); 5] = [
        (
            vec!["tune", "--backend", "exec", "--target", device],
            "needs the trial runner",
        ),
        (
            vec!["tune", "--target", device, "--", "python3"],
            "--backend exec",
        ),
        (vec!["run", "--backend", "exec", "--", "python3"], "export"),
        (
            vec![
                "tune",
                "--backend",
                "exec",
                "--target",
                device,
                "--data-parallel",
                "2",
            ],
            "--data-parallel 2",
        ),
        (
            vec![
                "tune",
                "--backend",
                "exec",
                "--target",
                device,
                "--isolation",
                "in-process",
            ],
            "--isolation in-process",
        ),
    ];
    for (i, (args, says)) in cases.into_iter().enumerate() {
        let out = if i >= 3 {
            with_runner(&args)
        } else {
            autotune_in(dir.path(), &args)
        };
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
}

/// However autotune ends while a runner's trial runs, the runner and every process it started
/// end too: on an interrupt, autotune kills them itself; killed with SIGKILL, which no handler
/// sees, its runner watchdog does.
#[test]
fn a_tune_that_ends_stops_the_runner_and_everything_it_started() {
    use rustix::process::Signal;
    // (the signal autotune gets, its exit code)
    for (signal, code) in [(Signal::INT, Some(130)), (Signal::KILL, None)] {
        let dir = tempfile::tempdir().unwrap();
        let device = device_file(dir.path());
        let pids = dir.path().join("pids");
        let argv = runner_argv(&[
            "--at",
            "1:hang",
            "--at",
            "2:hang",
            "--pid-file",
            pids.to_str().unwrap(),
        ]);
        let mut args = vec![
            "tune",
            "--model",
            "tiny",
            "--target",
            device.to_str().unwrap(),
            "--backend",
            "exec",
            "--max-micro-batch",
            "2",
            "--",
        ];
        args.extend(argv.iter().map(String::as_str));
        let (mut child, _stderr) = crate::util::spawn_in(dir.path(), &args);
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut text = String::new();
        while text.split_whitespace().count() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            text = std::fs::read_to_string(&pids).unwrap_or_default();
        }
        assert_eq!(
            text.split_whitespace().count(),
            2,
            "the runner started its trial"
        );
        let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
        rustix::process::kill_process(pid, signal).unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.code(), code, "{signal:?}");
        for pid in text.split_whitespace() {
            let pid: u32 = pid.parse().unwrap();
            assert!(
                wait_gone(pid),
                "{signal:?}: process {pid} of the runner lives on"
            );
        }
    }
}
