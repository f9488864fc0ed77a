//! Fuzzing every JSON reader (model spec, Hugging Face config, device spec, plan, recorded
//! profile, checkpoint state and manifest, a checkpoint's safetensors header, a trial runner's
//! reply) and the numeric command-line inputs: whatever the input, the answer is exit 0, 1 or
//! 2 within the case's time limit, never a panic (101), an abort (134) or a hang.
//!
//! `every_reader_and_flag_ends_in_an_answer` is the bounded run of `cargo test`: the readers
//! in this process (a panic fails the property) and a few cases through the binary. The long
//! run is ignored by default:
//!
//! ```sh
//! AUTOTUNE_FUZZ_CASES=10000 AUTOTUNE_FUZZ_SUMMARY=summary.json \
//!     cargo test --locked --test it fuzz::long_run -- --ignored --nocapture
//! ```
//!
//! It runs every case through the binary (built with the test profile, so arithmetic overflow
//! panics instead of wrapping) and writes the case count and the outcomes per input kind to
//! the summary; it fails if any case ended otherwise than in 0, 1 or 2 within its limit.

mod mutate;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use serde_json::Value;

use mutate::{FlagKind, Mutation};

use crate::util::{autotune_in, stderr};

/// A model small enough that its trials and steps take milliseconds.
const SMALL: &str = r#"{"name": "fuzz", "vocab_size": 32, "d_model": 16, "n_heads": 2, "n_layers": 1,
  "d_ff": 32, "seq_len": 8, "causal": true, "norm": "pre", "activation": "gelu",
  "positions": "learned", "dropout": 0.0, "norm_eps": 1e-5,
  "optimizer": {"kind": "adamw", "lr": 0.003, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}}"#;

/// A CPU target with 4 GiB of host memory.
const DEVICE: &str = r#"{"name": "fuzz-cpu", "kind": "cpu", "gpu_memory_bytes": null, "gpu_count": 1,
  "host_memory_bytes": 4294967296, "host_to_device_gbps": null, "notes": "fuzz"}"#;

/// A protocol-2 reply of a trial that fit, on a CPU target (no device memory). Its `id` is
/// [`REPLY_ID`], which the runner replaces with the id of the request it answers.
const REPLY: &str = r#"{"protocol": 2, "id": 918273645, "outcome": "fits", "engine": "fuzz-runner",
  "engine_version": "0.0-fuzz", "device": "fuzz cpu", "reusable": false, "step_times_s": [0.01, 0.011],
  "peak_gpu_bytes": 0, "peak_host_bytes": 104857600}"#;

/// The reply's `id`, a number no mutation writes (they write bounds, not this), so that the
/// runner finds it where the valid reply has it, and a mutation of it stays a wrong id.
const REPLY_ID: &str = "918273645";

/// A trial runner that answers every request line with the reply in the file it is given,
/// the request's `id` in place of [`REPLY_ID`]. It reads each request before answering, as the
/// protocol asks, so that a reply autotune skips leaves it waiting, as a real runner would.
const REPLY_RUNNER: &str = r#"import json, sys
reply = open(sys.argv[1], "rb").read()
while True:
    line = sys.stdin.buffer.readline()
    if not line:
        break
    request_id = str(json.loads(line)["id"]).encode()
    sys.stdout.buffer.write(reply.replace(b"REPLY_ID", request_id) + b"\n")
    sys.stdout.buffer.flush()
"#;

/// The trial limit of a case through a runner: a reply autotune skips (a mutated `id`) leaves
/// each trial waiting this long, and a runner is a Python process of milliseconds.
const REPLY_TRIAL_TIMEOUT: &str = "3";

/// How long one case may take before it counts as a hang.
const CASE_LIMIT: Duration = Duration::from_secs(120);

/// The tune flags that keep a live search to a few short trials, each stopped after 10 s.
const SHORT_TUNE: [(&str, &str); 6] = [
    ("--isolation", "child"),
    ("--trial-timeout", "10"),
    ("--max-trials", "2"),
    ("--max-micro-batch", "2"),
    ("--timed-steps", "1"),
    ("--trial-warmup-steps", "0"),
];

/// Valid documents of every kind, and a checkpoint to resume, made once.
struct Fixtures {
    dir: tempfile::TempDir,
    plan: Value,
    profile: Value,
    state: Value,
    manifest: Value,
    /// The checkpoint's weights: the header as JSON and the tensor bytes after it.
    header: Value,
    tensor_bytes: Vec<u8>,
}

impl Fixtures {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("small.json"), SMALL).unwrap();
        std::fs::write(d.join("device.json"), DEVICE).unwrap();
        let mut tune = vec!["tune", "--model", "small.json", "--target", "device.json"];
        for (flag, value) in SHORT_TUNE {
            tune.extend([flag, value]);
        }
        tune.extend(["--out", "plan.json", "--record", "profile.json"]);
        let out = autotune_in(d, &tune);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let train = [
            "train",
            "--model",
            "small.json",
            "--micro-batch",
            "2",
            "--data",
            "pattern",
            "--steps",
            "2",
            "--checkpoint-dir",
            "base-ck",
        ];
        let out = autotune_in(d, &train);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let read = |path: &str| -> Value {
            serde_json::from_str(&std::fs::read_to_string(d.join(path)).unwrap()).unwrap()
        };
        let weights = std::fs::read(d.join("base-ck/step-000002/model.safetensors")).unwrap();
        let header_len = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
        Self {
            plan: read("plan.json"),
            profile: read("profile.json"),
            state: read("base-ck/step-000002/state.json"),
            manifest: read("base-ck/step-000002/manifest.json"),
            header: serde_json::from_slice(&weights[8..8 + header_len]).unwrap(),
            tensor_bytes: weights[8 + header_len..].to_vec(),
            dir,
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// What a case feeds autotune.
#[derive(Debug, Clone)]
enum Case {
    /// A mutated document of one kind.
    Document(Reader, Vec<Mutation>),
    /// One numeric flag of one command set to a value.
    Flag(usize, String),
}

/// The JSON readers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Reader {
    ModelSpec,
    HfConfig,
    DeviceSpec,
    Plan,
    Profile,
    CheckpointState,
    CheckpointManifest,
    SafetensorsHeader,
    TrialReply,
}

/// Every numeric flag: the command, the flag, how its valid values can run.
const FLAGS: [(&str, &str, FlagKind); 30] = [
    ("train", "--micro-batch", FlagKind::Batch),
    ("train", "--grad-accum", FlagKind::Batch),
    ("train", "--steps", FlagKind::Steps),
    ("train", "--checkpoint-every", FlagKind::Any),
    ("train", "--eval-every", FlagKind::Any),
    ("train", "--seed", FlagKind::Any),
    ("train", "--keep-last", FlagKind::Any),
    ("train", "--data-parallel", FlagKind::Ranks),
    ("train", "--lr-warmup-steps", FlagKind::Any),
    ("train", "--min-lr", FlagKind::Any),
    ("tune", "--max-micro-batch", FlagKind::Any),
    ("tune", "--global-batch", FlagKind::Any),
    ("tune", "--max-trials", FlagKind::Any),
    ("tune", "--trial-warmup-steps", FlagKind::Any),
    ("tune", "--timed-steps", FlagKind::Any),
    ("tune", "--saturation-gain", FlagKind::Any),
    ("tune", "--headroom", FlagKind::Any),
    ("tune", "--data-parallel", FlagKind::Any),
    ("tune", "--trial-timeout", FlagKind::Any),
    ("probe", "--micro-batch", FlagKind::Batch),
    ("probe", "--grad-accum", FlagKind::Batch),
    ("probe", "--steps", FlagKind::Steps),
    ("probe", "--host-budget", FlagKind::Any),
    ("probe", "--gpu-capacity", FlagKind::Any),
    ("export", "--world-size", FlagKind::Any),
    ("check", "--time-tolerance", FlagKind::Any),
    ("check", "--memory-tolerance", FlagKind::Any),
    ("estimate", "--micro-batch", FlagKind::Any),
    ("estimate", "--grad-accum", FlagKind::Any),
    ("estimate", "--headroom", FlagKind::Any),
];

fn case() -> impl Strategy<Value = Case> {
    let reader = prop::sample::select(vec![
        Reader::ModelSpec,
        Reader::HfConfig,
        Reader::DeviceSpec,
        Reader::Plan,
        Reader::Profile,
        Reader::CheckpointState,
        Reader::CheckpointManifest,
        Reader::SafetensorsHeader,
        Reader::TrialReply,
    ]);
    let flag = (0..FLAGS.len())
        .prop_flat_map(|i| mutate::flag_value(FLAGS[i].2).prop_map(move |v| Case::Flag(i, v)));
    prop_oneof![
        5 => (reader, mutate::mutations()).prop_map(|(r, m)| Case::Document(r, m)),
        2 => flag,
    ]
}

impl Case {
    /// The kind of input, for the summary.
    fn kind(&self) -> String {
        match self {
            Case::Document(reader, _) => format!("{reader:?}"),
            Case::Flag(i, _) => format!("{} {}", FLAGS[*i].0, FLAGS[*i].1),
        }
    }

    /// Writes the case's files into `dir` and returns the arguments that feed them.
    fn prepare(&self, fx: &Fixtures, dir: &Path) -> Vec<String> {
        let base = fx.path().display().to_string();
        let small = format!("{base}/small.json");
        let device = format!("{base}/device.json");
        let plan = format!("{base}/plan.json");
        let profile = format!("{base}/profile.json");
        let short_tune = || {
            SHORT_TUNE
                .iter()
                .flat_map(|(f, v)| [f.to_string(), v.to_string()])
                .collect::<Vec<_>>()
        };
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<String>>();
        match self {
            Case::Document(reader, mutations) => {
                let base_doc = match reader {
                    Reader::ModelSpec => serde_json::from_str(SMALL).unwrap(),
                    Reader::HfConfig => hf_config(),
                    Reader::DeviceSpec => serde_json::from_str(DEVICE).unwrap(),
                    Reader::Plan => fx.plan.clone(),
                    Reader::Profile => fx.profile.clone(),
                    Reader::CheckpointState => fx.state.clone(),
                    Reader::CheckpointManifest => fx.manifest.clone(),
                    Reader::SafetensorsHeader => fx.header.clone(),
                    Reader::TrialReply => serde_json::from_str(REPLY).unwrap(),
                };
                let text = mutate::apply(&base_doc, mutations);
                match reader {
                    Reader::ModelSpec => {
                        std::fs::write(dir.join("doc.json"), text).unwrap();
                        let mut a = args(&["tune", "--model", "doc.json", "--target", &device]);
                        a.extend(short_tune());
                        a
                    }
                    Reader::HfConfig => {
                        std::fs::create_dir_all(dir.join("model")).unwrap();
                        std::fs::write(dir.join("model/config.json"), text).unwrap();
                        let mut a = args(&["tune", "--model", "model", "--target", &device]);
                        a.extend(short_tune());
                        a
                    }
                    Reader::DeviceSpec => {
                        std::fs::write(dir.join("doc.json"), text).unwrap();
                        let mut a = args(&["tune", "--model", &small, "--target", "doc.json"]);
                        a.extend(short_tune());
                        a
                    }
                    Reader::Plan => {
                        std::fs::write(dir.join("doc.json"), text).unwrap();
                        // Half export it, half draw its report.
                        if mutations.len() % 2 == 0 {
                            args(&["export", "--plan", "doc.json", "--format", "deepspeed"])
                        } else {
                            args(&["report", "doc.json", "--out", "report.html"])
                        }
                    }
                    Reader::Profile => {
                        std::fs::write(dir.join("doc.json"), text).unwrap();
                        // Replay a search from it, compare it with the good one, or draw it.
                        match mutations.len() % 3 {
                            0 => args(&["tune", "--backend", "replay:doc.json"]),
                            1 => args(&[
                                "check",
                                "--profile",
                                "doc.json",
                                "--backend",
                                &format!("replay:{profile}"),
                            ]),
                            _ => args(&["report", "doc.json", "--out", "report.html"]),
                        }
                    }
                    Reader::TrialReply => {
                        let mut a = args(&["tune", "--model", &small, "--target", &device]);
                        a.extend(short_tune());
                        through_runner(dir, &text, a)
                    }
                    Reader::CheckpointState
                    | Reader::CheckpointManifest
                    | Reader::SafetensorsHeader => {
                        let ck = dir.join("ck");
                        copy_dir(&fx.path().join("base-ck"), &ck);
                        let step = ck.join("step-000002");
                        let (file, bytes) = match reader {
                            Reader::CheckpointState => ("state.json", text),
                            Reader::CheckpointManifest => ("manifest.json", text),
                            _ => ("model.safetensors", safetensors(&text, &fx.tensor_bytes)),
                        };
                        std::fs::write(step.join(file), bytes).unwrap();
                        // A well-sealed wrong file reaches its reader; a broken seal is
                        // refused before it.
                        if mutations.len() != 2 && *reader != Reader::CheckpointManifest {
                            let names =
                                ["model.safetensors", "optimizer.safetensors", "state.json"];
                            autotune::train::checkpoint::manifest::Manifest::of(&step, &names)
                                .unwrap()
                                .write(&step)
                                .unwrap();
                        }
                        args(&[
                            "train",
                            "--model",
                            &small,
                            "--micro-batch",
                            "2",
                            "--data",
                            "pattern",
                            "--steps",
                            "3",
                            "--checkpoint-dir",
                            "ck",
                            "--resume",
                        ])
                    }
                }
            }
            Case::Flag(i, value) => {
                let (command, flag, _) = FLAGS[*i];
                let setting = format!("{flag}={value}");
                let mut a = match command {
                    "train" => {
                        let mut a = args(&[
                            "train",
                            "--model",
                            &small,
                            "--data",
                            "pattern",
                            "--checkpoint-dir",
                            "ck",
                            "--device",
                            "cpu",
                        ]);
                        for (f, v) in [("--steps", "2"), ("--micro-batch", "2")] {
                            if f != flag {
                                a.extend(args(&[f, v]));
                            }
                        }
                        a
                    }
                    "tune" => {
                        let mut a = args(&["tune", "--model", &small, "--target", &device]);
                        for (f, v) in SHORT_TUNE {
                            if f != flag {
                                a.extend(args(&[f, v]));
                            }
                        }
                        a
                    }
                    "probe" => {
                        let mut a = args(&[
                            "probe", "--model", &small, "--device", "cpu", "--warmup", "0",
                        ]);
                        if flag != "--steps" {
                            a.extend(args(&["--steps", "1"]));
                        }
                        a
                    }
                    "export" => args(&["export", "--plan", &plan, "--format", "deepspeed"]),
                    "estimate" => args(&["estimate", "--model", &small, "--target", &device]),
                    _ => args(&[
                        "check",
                        "--profile",
                        &profile,
                        "--backend",
                        &format!("replay:{profile}"),
                    ]),
                };
                a.push(setting);
                a
            }
        }
    }
}

/// `tune` (its arguments so far) with its trials asked of a runner in `dir` that answers every
/// request with `reply`, each trial limited to [`REPLY_TRIAL_TIMEOUT`].
fn through_runner(dir: &Path, reply: &[u8], mut tune: Vec<String>) -> Vec<String> {
    std::fs::write(dir.join("reply.json"), reply).unwrap();
    let runner = REPLY_RUNNER.replace("REPLY_ID", REPLY_ID);
    std::fs::write(dir.join("runner.py"), runner).unwrap();
    let limit = tune.iter().position(|f| f == "--trial-timeout").unwrap();
    tune[limit + 1] = REPLY_TRIAL_TIMEOUT.into();
    let runner = [
        "--backend",
        "exec",
        "--",
        "python3",
        "runner.py",
        "reply.json",
    ];
    tune.extend(runner.iter().map(|s| s.to_string()));
    tune
}

/// The tiny Llama fixture's `config.json`: a Hugging Face config of a model that trains in
/// milliseconds, with Llama 3's rotary scaling to mutate.
fn hf_config() -> Value {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/tiny-llama/config.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A safetensors file of `header` (whatever bytes) and the tensor bytes after it.
fn safetensors(header: &[u8], tensor_bytes: &[u8]) -> Vec<u8> {
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.extend_from_slice(tensor_bytes);
    file
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// How a case ended.
#[derive(Debug, Clone)]
struct Ended {
    /// The exit code, or `None` for a signal or a hang.
    code: Option<i32>,
    hung: bool,
    seconds: f64,
    /// The last lines of stderr, for the report of a bad ending.
    last_words: String,
}

impl Ended {
    fn is_an_answer(&self) -> bool {
        !self.hung && matches!(self.code, Some(0..=2))
    }

    fn label(&self) -> String {
        match (self.hung, self.code) {
            (true, _) => "hang".into(),
            (false, Some(code)) => format!("exit {code}"),
            (false, None) => "signal".into(),
        }
    }
}

/// Runs the binary in `dir` with `args`, killed after `limit`.
fn run(dir: &Path, args: &[String], limit: Duration) -> Ended {
    let started = Instant::now();
    let child = super::util::command()
        .current_dir(dir)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let (output, hung) = match rx.recv_timeout(limit) {
        Ok(output) => (output.ok(), false),
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            (rx.recv().ok().and_then(Result::ok), true)
        }
    };
    let _ = waiter.join();
    let last_words = output
        .as_ref()
        .map(|o| {
            let text = String::from_utf8_lossy(&o.stderr);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(4)..].join("\n")
        })
        .unwrap_or_default();
    Ended {
        code: output.and_then(|o| o.status.code()),
        hung,
        seconds: started.elapsed().as_secs_f64(),
        last_words,
    }
}

/// What a fuzz run found.
struct Found {
    /// Per input kind, how many cases ended how.
    outcomes: BTreeMap<String, BTreeMap<String, usize>>,
    /// Every case that did not end in an answer.
    bad: Vec<String>,
    slowest_s: f64,
}

/// Generates `cases` cases from a fixed seed and runs each through the binary, `parallel` at a
/// time.
fn fuzz_binary(cases: usize, seed: u8, parallel: usize) -> Found {
    let fx = Fixtures::new();
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
    );
    let strategy = case();
    let all: Vec<Case> = (0..cases)
        .map(|_| strategy.new_tree(&mut runner).expect("a case").current())
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let found = std::sync::Mutex::new(Found {
        outcomes: BTreeMap::new(),
        bad: Vec::new(),
        slowest_s: 0.0,
    });
    std::thread::scope(|scope| {
        for _ in 0..parallel.max(1) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Some(case) = all.get(i) else { break };
                let dir = tempfile::tempdir().unwrap();
                let args = case.prepare(&fx, dir.path());
                let ended = run(dir.path(), &args, CASE_LIMIT);
                let mut found = found.lock().unwrap();
                found.slowest_s = found.slowest_s.max(ended.seconds);
                *found
                    .outcomes
                    .entry(case.kind())
                    .or_default()
                    .entry(ended.label())
                    .or_default() += 1;
                if !ended.is_an_answer() {
                    found.bad.push(format!(
                        "case {i}: {case:?}\n  args {args:?}\n  {} after {:.1} s\n  {}",
                        ended.label(),
                        ended.seconds,
                        ended.last_words
                    ));
                }
            });
        }
    });
    found.into_inner().unwrap()
}

/// The readers in this process: a panic anywhere fails the property. `tensor_bytes` follow a
/// safetensors header.
fn read_in_process(reader: Reader, text: &str, tensor_bytes: &[u8]) {
    match reader {
        // A Hugging Face config is read by the spec's reader, as `--model` reads it.
        Reader::ModelSpec | Reader::HfConfig => {
            if let Ok(spec) = autotune::ModelSpec::from_json(text) {
                let _ = autotune::spec::limits::state_bytes(&spec);
                let _ = spec.parameter_count();
            }
        }
        Reader::DeviceSpec => {
            if let Ok(device) = autotune::spec::device::DeviceSpec::from_json(text) {
                let _ = autotune::spec::budget::Budget::from_device(&device).usable_host_bytes();
            }
        }
        Reader::Plan => {
            if let Ok(plan) = autotune::plan::Plan::from_json(text) {
                let o = &plan.model.optimizer;
                let _ = autotune::plan::exports::deepspeed_config(&plan.knobs, o, 1 << 20);
                let _ = autotune::plan::exports::trainer_args(&plan.knobs, o);
                let _ = autotune::plan::exports::accelerate_config(&plan.knobs);
                let _ = autotune::plan::exports::lightning_args(&plan.knobs, o.grad_clip);
            }
        }
        Reader::Profile => {
            if let Ok(profile) = autotune::profile::record::Profile::from_json(text) {
                let report = autotune::profile::check::check(
                    &profile,
                    &profile.trials,
                    autotune::profile::check::Tolerance::default(),
                );
                let _ = report.passed();
            }
        }
        Reader::CheckpointState => {
            let _ = autotune::train::checkpoint::RunState::from_json(text);
        }
        Reader::CheckpointManifest => {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("manifest.json"), text).unwrap();
            let _ = autotune::train::checkpoint::manifest::verify(dir.path());
        }
        Reader::SafetensorsHeader => {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("model.safetensors");
            std::fs::write(&path, safetensors(text.as_bytes(), tensor_bytes)).unwrap();
            if let Ok(file) = autotune::hf::safetensors::SafetensorsFile::open_state(&path) {
                for name in file.names() {
                    let _ = file.read(name);
                }
            }
        }
        Reader::TrialReply => {
            // As the runner writes it to request 1, and as the search reads it for a trial.
            let line = text.replace(REPLY_ID, "1");
            if let Some(Ok(reply)) = autotune::trial_protocol::parse_reply_line(&line, 1) {
                let knobs = autotune::Knobs::new(2, autotune::Precision::Fp32);
                let _ = reply.outcome(&knobs, 8);
            }
        }
    }
}

#[test]
fn every_reader_and_flag_ends_in_an_answer() {
    let fx = Fixtures::new();
    let bases = [
        (
            Reader::ModelSpec,
            serde_json::from_str::<Value>(SMALL).unwrap(),
        ),
        (Reader::HfConfig, hf_config()),
        (Reader::DeviceSpec, serde_json::from_str(DEVICE).unwrap()),
        (Reader::Plan, fx.plan.clone()),
        (Reader::Profile, fx.profile.clone()),
        (Reader::CheckpointState, fx.state.clone()),
        (Reader::CheckpointManifest, fx.manifest.clone()),
        (Reader::SafetensorsHeader, fx.header.clone()),
        (Reader::TrialReply, serde_json::from_str(REPLY).unwrap()),
    ];
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    for (reader, base) in bases {
        runner
            .run(&mutate::mutations(), |m| {
                let text = mutate::apply(&base, &m);
                read_in_process(reader, &String::from_utf8_lossy(&text), &fx.tensor_bytes);
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{reader:?}: {e}"));
    }
    // The valid reply gives a plan: the runner works, so the mutated replies reach the reader.
    let dir = tempfile::tempdir().unwrap();
    let args = Case::Document(Reader::TrialReply, vec![]).prepare(&fx, dir.path());
    let ended = run(dir.path(), &args, CASE_LIMIT);
    assert_eq!(ended.code, Some(0), "{args:?}\n{}", ended.last_words);
    drop(fx);
    let found = fuzz_binary(100, 7, 1);
    assert!(
        found.bad.is_empty(),
        "{:?}\n{}",
        found.outcomes,
        found.bad.join("\n")
    );
}

#[test]
#[ignore = "the long fuzz run: minutes; see the module docs for the command"]
fn long_run() {
    let cases: usize = std::env::var("AUTOTUNE_FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(10_000);
    let parallel: usize = std::env::var("AUTOTUNE_FUZZ_PARALLEL")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2);
    let started = Instant::now();
    let found = fuzz_binary(cases, 42, parallel);
    let bad = &found.bad;
    let summary = serde_json::json!({
        "cases": cases,
        "seed": 42,
        "parallel": parallel,
        "case_limit_s": CASE_LIMIT.as_secs(),
        "answers": cases - bad.len(),
        "not_answers": bad.len(),
        "slowest_case_s": found.slowest_s,
        "wall_s": started.elapsed().as_secs_f64(),
        "outcomes": found.outcomes,
        "failures": bad,
    });
    let text = serde_json::to_string_pretty(&summary).unwrap();
    if let Ok(path) = std::env::var("AUTOTUNE_FUZZ_SUMMARY") {
        std::fs::write(PathBuf::from(path), format!("{text}\n")).unwrap();
    }
    eprintln!("{text}");
    assert!(
        bad.is_empty(),
        "{} of {cases} cases did not end in an answer",
        bad.len()
    );
}
