//! Trials outside the searching process: a fresh child per trial, and a worker that serves
//! trial after trial until one of them does not end clean.

use std::path::PathBuf;

use autotune::knobs::{Knobs, Precision};
use autotune::probe::child::ChildProber;
use autotune::probe::job::{TrialProcesses, TrialSetup};
use autotune::probe::worker::WorkerProber;
use autotune::probe::Prober;
use autotune::trial::{Outcome, TrialRequest};

use crate::util::{self, small_gpt};

/// Trials of `spec` on the CPU within `host_budget`, each run by `program`.
fn processes(
    program: PathBuf,
    spec: &autotune::ModelSpec,
    host_budget: Option<u64>,
) -> TrialProcesses {
    TrialProcesses::new(program, TrialSetup::new(spec, "cpu", None, host_budget))
}

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_autotune"))
}

fn request(micro_batch: usize) -> TrialRequest {
    TrialRequest {
        knobs: Knobs::new(micro_batch, Precision::Fp32),
        warmup_steps: 1,
        timed_steps: 2,
        remeasure: false,
    }
}

fn measured(outcome: &Outcome) -> (u64, f64) {
    let m = outcome.measurement().expect("the trial fits");
    assert!(m.step_time_median_s > 0.0 && m.tokens_per_s > 0.0, "{m:?}");
    (m.peak_host_bytes, m.tokens_per_s)
}

#[test]
fn a_worker_runs_consecutive_trials_and_measures_them_as_fresh_children_do() {
    let spec = small_gpt();
    let mut worker = WorkerProber::new(processes(exe(), &spec, Some(8 << 30)));
    let mut child = ChildProber::new(processes(exe(), &spec, Some(8 << 30)));
    for mb in [1, 4, 8] {
        let by_worker = worker.probe(&request(mb)).unwrap();
        let by_child = child.probe(&request(mb)).unwrap();
        assert_eq!(by_worker.request, request(mb));
        let (worker_host, _) = measured(&by_worker.outcome);
        let (child_host, _) = measured(&by_child.outcome);
        // The heap a trial takes is its own: the worker's earlier trials leave nothing that
        // counts towards the next one's peak beyond a little bookkeeping.
        let diff = worker_host.abs_diff(child_host) as f64;
        assert!(
            diff <= 0.05 * child_host as f64 + (1 << 20) as f64,
            "mb {mb}: worker {worker_host} vs child {child_host} host bytes"
        );
    }
    assert_eq!(worker.workers_started(), 1, "one worker served every trial");
}

#[test]
fn a_trial_that_kills_its_worker_is_a_crash_and_the_next_trial_gets_a_new_worker() {
    let spec = small_gpt();
    let mut worker = WorkerProber::new(processes(exe(), &spec, None));
    let fits = worker.probe(&request(2)).unwrap();
    measured(&fits.outcome);
    // Zero sequences per micro-batch is refused inside the trial: the worker exits with the
    // error, and its last words become the outcome.
    let broken = worker.probe(&request(0)).unwrap();
    match &broken.outcome {
        Outcome::Crashed { reason } => assert!(reason.contains("micro_batch"), "{reason}"),
        other => panic!("expected a crash, got {other:?}"),
    }
    let again = worker.probe(&request(2)).unwrap();
    measured(&again.outcome);
    assert_eq!(worker.workers_started(), 2);
}

#[test]
fn tune_with_a_worker_finds_the_same_host_boundary_as_in_process() {
    // The exact boundary of a host budget does not depend on where trials run.
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model.json");
    // About 0.4 MB of heap per sequence: the boundary sits at a couple of hundred.
    std::fs::write(
        &model,
        r#"{"preset": "tiny", "name": "micro", "d_model": 32, "n_heads": 2, "d_ff": 64, "seq_len": 32}"#,
    )
    .unwrap();
    let device = dir.path().join("device.json");
    std::fs::write(
        &device,
        r#"{"name": "small-host", "kind": "cpu", "host_memory_bytes": 41943040}"#,
    )
    .unwrap();
    let plan_of = |isolation: &str| {
        let out = util::autotune(&[
            "tune",
            "--model",
            model.to_str().unwrap(),
            "--target",
            device.to_str().unwrap(),
            "--checkpointing",
            "none",
            "--saturation-gain",
            "0",
            "--max-micro-batch",
            "512",
            "--isolation",
            isolation,
            "--json",
        ]);
        assert!(out.status.success(), "{}", util::stderr(&out));
        let plan: serde_json::Value = serde_json::from_str(&util::stdout(&out)).unwrap();
        let usable = plan["budget"]["host_bytes"].as_f64().unwrap()
            * (1.0 - plan["budget"]["headroom"].as_f64().unwrap());
        // The largest micro-batch that fitted the usable bytes: the search pins it exactly.
        plan["evidence"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["outcome"] == "fits" && t["peak_host_bytes"].as_f64().unwrap() <= usable)
            .map(|t| t["request"]["knobs"]["micro_batch"].as_u64().unwrap())
            .max()
            .unwrap()
    };
    let in_process = plan_of("in-process");
    assert!(in_process > 1 && in_process < 512, "{in_process}");
    assert_eq!(plan_of("worker"), in_process);
}

/// An executable that takes its job and never answers: a trial stuck in a kernel or a
/// collective, as seen from the parent.
fn hanging_trial(dir: &std::path::Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("hangs.sh");
    std::fs::write(&path, "#!/bin/sh\nexec tail -f /dev/null\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[test]
fn a_trial_past_its_time_limit_is_timed_out_and_the_next_gets_a_fresh_worker() {
    use autotune::probe::timeout::TrialTimeout;
    let dir = tempfile::tempdir().unwrap();
    let hangs = hanging_trial(dir.path());
    let spec = small_gpt();
    let limit = TrialTimeout::fixed(std::time::Duration::from_millis(300));
    let mut child =
        ChildProber::new(processes(hangs.clone(), &spec, None).with_timeout(limit.clone()));
    let result = child.probe(&request(2)).unwrap();
    assert!(
        matches!(result.outcome, Outcome::TimedOut { after_s } if after_s == 0.3),
        "{result:?}"
    );
    let mut worker = WorkerProber::new(processes(hangs, &spec, None).with_timeout(limit));
    for _ in 0..2 {
        let result = worker.probe(&request(2)).unwrap();
        assert!(
            matches!(result.outcome, Outcome::TimedOut { .. }),
            "{result:?}"
        );
    }
    assert_eq!(
        worker.workers_started(),
        2,
        "a timed-out worker is replaced"
    );
}

/// A worker whose autotune is killed ends with it, instead of holding its trial's memory until
/// the trial is over. A shell stands for the autotune: it names itself the worker's parent and
/// is killed while the worker waits for a job on a pipe that this test keeps open. The worker is
/// killed by the kernel, not by its own check that its parent is gone (which would say so).
#[cfg(target_os = "linux")]
#[test]
fn a_worker_ends_when_the_autotune_that_started_it_is_killed() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let variable = autotune::probe::lifetime::PARENT_VARIABLE;
    let dir = tempfile::tempdir().unwrap();
    let said = dir.path().join("worker.stderr");
    let mut shell = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "exec 3<&0; {variable}=$$ \"$0\" probe-serve <&3 2>\"$1\" & echo $!; wait"
        ))
        .arg(exe())
        .arg(&said)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(shell.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let worker: u32 = line.trim().parse().unwrap();
    // Alive: the process exists and is not a zombie waiting to be reaped.
    let alive = || {
        std::fs::read_to_string(format!("/proc/{worker}/stat"))
            .map(|stat| !stat.contains(") Z "))
            .unwrap_or(false)
    };
    // The worker has tied itself to the shell once it waits for its first job: in a read of
    // its standard input (system call 0 on x86-64, 63 on AArch64, first argument 0).
    let read = if cfg!(target_arch = "aarch64") { 63 } else { 0 };
    let waiting = || {
        std::fs::read_to_string(format!("/proc/{worker}/syscall"))
            .map(|call| call.starts_with(&format!("{read} 0x0 ")))
            .unwrap_or(false)
    };
    let started = Instant::now();
    while !waiting() && started.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(alive(), "the worker should wait for its first job");
    // Held apart from the shell's handle: waiting for the shell would close it.
    let job_pipe = shell.stdin.take();
    shell.kill().unwrap();
    shell.wait().unwrap();
    let killed = Instant::now();
    while alive() && killed.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let survived = alive();
    drop(job_pipe);
    assert!(!survived, "the worker outlived the process that started it");
    let said = std::fs::read_to_string(&said).unwrap_or_default();
    assert!(
        !said.contains("has ended"),
        "ended by its own check: {said}"
    );
}

/// A trial process whose named parent is not its parent (that autotune has ended) stops at once
/// with an error that says so, rather than run a trial no one will read.
#[cfg(target_os = "linux")]
#[test]
fn a_trial_process_whose_parent_has_ended_stops_at_once() {
    use std::process::{Command, Stdio};
    let variable = autotune::probe::lifetime::PARENT_VARIABLE;
    // (the variable's value, what the error must say)
    let cases = [("1", "(process 1) has ended"), ("the parent", variable)];
    for command in ["probe-serve", "probe-one"] {
        for (value, said) in cases {
            let out = Command::new(exe())
                .arg(command)
                .env(variable, value)
                .stdin(Stdio::null())
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{command} {value}: {stderr}");
            assert!(stderr.contains(said), "{command} {value}: {stderr}");
        }
    }
}

/// On a GPU, a trial leaves the memory pool empty once trimmed, so that a worker serves trial
/// after trial: the fused products' cuBLASLt workspace lives outside the pool (inside it, it was
/// left over after every trial, and every trial started a new worker). Run it alone
/// (`--test-threads=1`): another test's tensors would share the pool (needs a CUDA device).
#[cfg(feature = "cuda")]
#[test]
fn cuda_a_trial_with_fused_products_leaves_the_pool_empty() {
    use autotune::probe::live::LiveProber;
    let device = autotune::backend::open("cuda").unwrap();
    let memory = autotune::backend::memory_meter(&device, None).unwrap();
    let mut prober = LiveProber::new(&small_gpt(), &device, None, memory);
    for micro_batch in [1, 2] {
        let request = TrialRequest {
            knobs: Knobs::new(micro_batch, Precision::Bf16),
            ..request(micro_batch)
        };
        let result = prober.probe(&request).unwrap();
        assert!(result.outcome.measurement().is_some(), "{result:?}");
        assert_eq!(
            prober.leftover_device_bytes().unwrap(),
            0,
            "left in the pool after micro-batch {micro_batch}"
        );
    }
}
