//! The trial protocol against runners that break it (`tests/fixtures/exec/fake_runner.py`): one
//! whose child escapes with `setsid`. No process of a runner outlives its trial.

use std::path::Path;
use std::time::{Duration, Instant};

use autotune::trial::{Outcome, Prober};

use crate::exec::{prober, request, tune, wait_gone};
use crate::util::stderr;

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
