//! The trial protocol against runners that break it (`tests/fixtures/exec/fake_runner.py`): one
//! that answers twice or late, one that never reads its requests, one whose child escapes
//! with `setsid`, one that answers NaN. The search stays correct and bounded in time, and no
//! process of a runner outlives its trial.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use autotune::probe::exec::ExecProber;
use autotune::probe::job::{TrialProcesses, TrialSetup};
use autotune::probe::runner::RunnerCommand;
use autotune::probe::timeout::TrialTimeout;
use autotune::trial::{Outcome, Prober};
use autotune::ModelSpec;

use crate::exec::{crash_reason, prober, request, runner_argv, tune, wait_gone};
use crate::util::{stderr, stdout};

const MIB: u64 = 1 << 20;

/// The fake runner's device memory at `micro_batch` with its default law, 1024 + 100·mb MiB.
fn law_bytes(micro_batch: u64) -> u64 {
    (1024 + 100 * micro_batch) * MIB
}

/// Runs trials at micro-batches 1 to 9 and checks each measured its own micro-batch.
fn each_trial_measures_its_own_setting(exec: &mut ExecProber) {
    for mb in 1..=9 {
        let result = exec.probe(&request(mb)).expect("a trial is an outcome");
        let Outcome::Fits(m) = &result.outcome else {
            panic!("{mb}: {result:?}");
        };
        assert_eq!(m.peak_gpu_bytes, law_bytes(mb as u64), "trial {mb}");
    }
}

#[test]
fn a_reply_written_twice_or_late_is_never_taken_for_another_trial() {
    // A late duplicate arrives after the next request: only the id tells it apart, and the
    // runner that wrote it still serves.
    let mut late = prober(&["--serve", "--stale"]);
    each_trial_measures_its_own_setting(&mut late);
    assert_eq!(late.runners_started(), 1);
    // A reply written twice at once is seen before the next request, of either version:
    // the runner that wrote it serves no further trial.
    for version in ["2", "1"] {
        let mut twice = prober(&["--serve", "--twice", "--protocol", version]);
        each_trial_measures_its_own_setting(&mut twice);
        assert_eq!(twice.runners_started(), 9, "protocol {version}");
    }
}

#[test]
fn a_search_through_a_runner_of_version_1_that_answers_twice_finds_the_boundary() {
    let dir = tempfile::tempdir().unwrap();
    let out = tune(
        dir.path(),
        &["--checkpointing", "none", "--offload", "none", "--json"],
        &["--over", "mixed", "--serve", "--twice", "--protocol", "1"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let plan: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(plan["knobs"]["micro_batch"], 28, "{}", stderr(&out));
    let evidence = plan["evidence"].as_array().unwrap();
    let fits: Vec<&Value> = evidence.iter().filter(|t| t["outcome"] == "fits").collect();
    assert!(fits.len() >= 3, "{evidence:?}");
    for trial in fits {
        let mb = trial["request"]["knobs"]["micro_batch"].as_u64().unwrap();
        assert_eq!(
            trial["peak_gpu_bytes"].as_u64(),
            Some(law_bytes(mb)),
            "trial at {mb} carries its own measurement: {trial}"
        );
    }
}

/// A prober of a model whose request line is larger than a pipe holds, asking `runner`.
fn large_request_prober(args: &[&str], limit: Duration) -> ExecProber {
    let model = ModelSpec {
        name: "m".repeat(4 * MIB as usize),
        ..ModelSpec::tiny()
    };
    let setup = TrialSetup::new(&model, "cuda", Some(4 << 30), Some(32 << 30));
    let command = RunnerCommand::new(&runner_argv(args)).unwrap();
    ExecProber::new(TrialProcesses::new(command, setup).with_timeout(TrialTimeout::fixed(limit)))
}

#[test]
fn a_runner_that_never_reads_times_out_and_stops_the_search_on_the_second_trial() {
    let started = Instant::now();
    let mut deaf = large_request_prober(&["--deaf"], Duration::from_secs(2));
    let first = deaf.probe(&request(1)).expect("a timeout is an outcome");
    assert_eq!(first.outcome, Outcome::TimedOut { after_s: 2.0 });
    let err = deaf.probe(&request(2)).unwrap_err().to_string();
    assert!(
        err.contains("fake_runner.py --deaf")
            && err.contains("has not replied")
            && err.contains("--trial-timeout"),
        "names the runner and the fix: {err}"
    );
    // Two limits of 2 s, not a write that blocks for ever.
    assert!(started.elapsed() < Duration::from_secs(60));

    // A runner that has replied once may time out as often as the search meets it.
    let mut hangs = prober(&["--at", "2:hang", "--at", "3:hang"]);
    assert!(matches!(
        hangs.probe(&request(1)).unwrap().outcome,
        Outcome::Fits(_)
    ));
    for mb in [2, 3] {
        let result = hangs.probe(&request(mb)).unwrap();
        assert!(
            matches!(result.outcome, Outcome::TimedOut { .. }),
            "{result:?}"
        );
    }
}

#[test]
fn a_search_through_a_runner_that_never_answers_stops_with_exit_2_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let out = tune(dir.path(), &[], &["--deaf"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("fake_runner.py --deaf`") && err.contains("--trial-timeout"),
        "{err}"
    );
    // Two trials of 5 s each, not one for each of the search's trials.
    assert!(started.elapsed() < Duration::from_secs(120));
}

/// The pid a runner wrote to `file`.
fn written_pid(file: &Path) -> u32 {
    std::fs::read_to_string(file)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn a_child_that_escapes_with_setsid_is_killed_with_its_runner() {
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    let pid_file = pids.to_str().unwrap();
    // A runner that ends with its trial: the escaped child goes with it.
    let mut once = prober(&["--at", "1:escape", "--pid-file", pid_file]);
    assert!(matches!(
        once.probe(&request(1)).unwrap().outcome,
        Outcome::Fits(_)
    ));
    let escaped = written_pid(&pids);
    assert!(wait_gone(escaped), "process {escaped} outlived its trial");

    // A runner that serves keeps it while it serves, and the search's end stops it.
    let mut serving = prober(&["--serve", "--at", "1:escape", "--pid-file", pid_file]);
    assert!(matches!(
        serving.probe(&request(1)).unwrap().outcome,
        Outcome::Fits(_)
    ));
    let escaped = written_pid(&pids);
    assert!(!wait_gone_within(escaped, Duration::from_millis(300)));
    drop(serving);
    assert!(wait_gone(escaped), "process {escaped} outlived the search");
}

#[test]
fn a_search_leaves_no_escaped_child_behind() {
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    let out = tune(
        dir.path(),
        &["--checkpointing", "none", "--offload", "none"],
        &[
            "--serve",
            "--at",
            "16:escape",
            "--at",
            "64:oom",
            "--pid-file",
            pids.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let escaped = written_pid(&pids);
    assert!(wait_gone(escaped), "process {escaped} outlived autotune");
}

fn wait_gone_within(pid: u32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if crate::exec::gone(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

#[test]
fn a_reply_with_nan_is_refused_at_once_naming_the_field() {
    let setup = TrialSetup::new(&ModelSpec::tiny(), "cuda", Some(4 << 30), Some(32 << 30));
    let command = RunnerCommand::new(&runner_argv(&["--at", "1:nan"])).unwrap();
    let mut exec = ExecProber::new(
        TrialProcesses::new(command, setup)
            .with_timeout(TrialTimeout::fixed(Duration::from_secs(600))),
    );
    let result = exec.probe(&request(1)).unwrap();
    let reason = crash_reason(&result.outcome);
    assert!(
        reason.contains("step_times_s[1]") && reason.contains("NaN"),
        "{reason}"
    );
    assert!(result.wall_s < 60.0, "not waited on: {}", result.wall_s);

    let dir = tempfile::tempdir().unwrap();
    let out = tune(
        dir.path(),
        &["--checkpointing", "none", "--offload", "none", "--json"],
        &["--over", "nan", "--serve"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let plan: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(plan["knobs"]["micro_batch"], 28, "{}", stderr(&out));
    assert!(plan["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["reason"]
            .as_str()
            .is_some_and(|r| r.contains("step_times_s[1]"))));
}
