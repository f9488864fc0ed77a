use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::Device;
use serde_json::Value;

use autotune::collective::tcp::TcpGroup;
use autotune::collective::Collective;
use autotune::data::source::{Data, DataSpec};
use autotune::knobs::{DataParallel, Knobs, Precision};
use autotune::spec::model::ModelSpec;
use autotune::train::optimizer::OptimizerState;
use autotune::train::step::Trainer;

use crate::token_files::{empty_in_place, token_file};
use crate::util::{autotune, autotune_in, small_gpt, small_seed, stderr, stdout};

/// What a run left behind: the loss of every step and the final weights.
struct Trained {
    losses: Vec<f64>,
    weights: Vec<Vec<f32>>,
    /// Moments this rank's optimizer holds, and the model's parameter count.
    owned_params: (usize, usize),
}

fn train(spec: &ModelSpec, knobs: Knobs, steps: usize, group: Collective) -> Trained {
    let data = Data::open(&DataSpec::Random, spec).unwrap();
    let mut trainer = Trainer::in_group(spec, knobs, &Device::Cpu, 5, group).unwrap();
    let losses = (0..steps)
        .map(|_| trainer.step(&data).unwrap().loss)
        .collect();
    let weights = trainer
        .master_weights()
        .unwrap()
        .iter()
        .map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect();
    let owned = match trainer.optimizer() {
        OptimizerState::Device(adam) => adam.owned().len(),
        OptimizerState::Host(_) | OptimizerState::Compact(_) => weights_len(&trainer),
    };
    Trained {
        losses,
        weights,
        owned_params: (owned, weights_len(&trainer)),
    }
}

fn weights_len(trainer: &Trainer) -> usize {
    trainer.model().params().vars().len()
}

/// Trains `knobs` on `knobs.data_parallel.degree` ranks, each a thread of this test with its
/// own TCP connection (the same group the launched processes form); one result per rank.
fn train_ranks(spec: &ModelSpec, knobs: Knobs, steps: usize) -> Vec<Trained> {
    let world = knobs.data_parallel.degree;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let others: Vec<_> = (1..world)
        .map(|rank| {
            let spec = spec.clone();
            std::thread::spawn(move || {
                let group = TcpGroup::join(rank, world, addr).unwrap();
                train(&spec, knobs, steps, Collective::Tcp(group))
            })
        })
        .collect();
    let root = train(
        spec,
        knobs,
        steps,
        Collective::Tcp(TcpGroup::host(&listener, world).unwrap()),
    );
    let mut all = vec![root];
    all.extend(others.into_iter().map(|h| h.join().unwrap()));
    all
}

fn knobs(micro_batch: usize, grad_accum: usize, data_parallel: DataParallel) -> Knobs {
    Knobs {
        grad_accum,
        data_parallel,
        ..Knobs::new(micro_batch, Precision::Fp32)
    }
}

fn bits(w: &[Vec<f32>]) -> Vec<Vec<u32>> {
    w.iter()
        .map(|t| t.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// The must-show on the CPU. Two ranks of one micro-batch each scale every loss by 1/2, as one
/// process accumulating the same two micro-batches does (data and dropout follow the global
/// micro-batch index), and the group sums rank 0's gradient and then rank 1's, the order the
/// single process accumulates in. So nothing at all differs: losses and weights are equal to
/// the last bit, with and without dropout.
#[test]
fn two_ranks_train_bit_identically_to_one_process_accumulating_their_micro_batches() {
    for spec in [small_gpt(), small_seed(0.1)] {
        let single = train(
            &spec,
            knobs(4, 2, DataParallel::SINGLE),
            4,
            Collective::Single,
        );
        let ranks = train_ranks(&spec, knobs(4, 1, DataParallel::replicated(2)), 4);
        for (rank, r) in ranks.iter().enumerate() {
            assert_eq!(
                r.losses, single.losses,
                "{}: rank {rank}'s losses",
                spec.name
            );
            assert!(
                bits(&r.weights) == bits(&single.weights),
                "{}: rank {rank}'s weights differ from the single process",
                spec.name
            );
        }
        // The runs trained: the comparison is not between untouched models.
        assert_ne!(single.losses[0], single.losses[3]);
    }
}

/// With two micro-batches per rank the sum is associated differently: one process adds
/// ((g0 + g1) + g2) + g3, the ranks (g0 + g1) + (g2 + g3). That, and nothing else, differs, so
/// losses agree to f32 rounding and so do the weights after Adam's steps.
#[test]
fn accumulating_on_each_rank_matches_one_process_up_to_the_order_of_the_sum() {
    let spec = small_gpt();
    let single = train(
        &spec,
        knobs(2, 4, DataParallel::SINGLE),
        4,
        Collective::Single,
    );
    let ranks = train_ranks(&spec, knobs(2, 2, DataParallel::replicated(2)), 4);
    for r in &ranks {
        for (step, (a, b)) in r.losses.iter().zip(&single.losses).enumerate() {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "step {step}: {a} vs {b}");
        }
        let worst = r
            .weights
            .iter()
            .flatten()
            .zip(single.weights.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "weights differ by up to {worst}");
    }
    // Every rank ends with the same bits: the group hands everyone one result.
    assert!(bits(&ranks[0].weights) == bits(&ranks[1].weights));
}

#[test]
fn a_sharded_optimizer_trains_the_same_weights_holding_half_the_moments_per_rank() {
    let spec = small_seed(0.0);
    let sharded = DataParallel {
        degree: 2,
        shard_optimizer: true,
    };
    let plain = train_ranks(&spec, knobs(4, 1, DataParallel::replicated(2)), 3);
    let shared = train_ranks(&spec, knobs(4, 1, sharded), 3);
    for (p, s) in plain.iter().zip(&shared) {
        assert_eq!(p.losses, s.losses);
        assert!(
            bits(&p.weights) == bits(&s.weights),
            "sharding changed the weights"
        );
    }
    let (owned0, total) = shared[0].owned_params;
    let (owned1, _) = shared[1].owned_params;
    assert_eq!(
        owned0 + owned1,
        total,
        "each parameter has exactly one owner"
    );
    assert!(owned0 > 0 && owned1 > 0, "{owned0} + {owned1}");
    assert_eq!(plain[0].owned_params, (total, total));
}

/// The fp16 overflow decision is the group's: rank 1 alone starts at a loss scale that
/// overflows, and rank 0, whose own gradients are finite, skips that step with it (the ranks'
/// gradients are summed before the check), so their weights stay equal.
#[test]
fn one_ranks_fp16_overflow_makes_every_rank_skip_the_step() {
    let spec = small_gpt();
    let k = Knobs {
        precision: Precision::Fp16,
        ..knobs(4, 1, DataParallel::replicated(2))
    };
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let run = move |group: Collective, scale: f64| {
        let data = Data::open(&DataSpec::Pattern, &spec).unwrap();
        let mut trainer = Trainer::in_group(&spec, k, &Device::Cpu, 5, group).unwrap();
        trainer.scaler_mut().scale = scale;
        let reports: Vec<_> = (0..2).map(|_| trainer.step(&data).unwrap()).collect();
        let weights = trainer
            .master_weights()
            .unwrap()
            .iter()
            .map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect::<Vec<_>>();
        (reports, weights)
    };
    let other = {
        let run = run.clone();
        std::thread::spawn(move || {
            run(
                Collective::Tcp(TcpGroup::join(1, 2, addr).unwrap()),
                2f64.powi(40),
            )
        })
    };
    let (root, root_weights) = run(
        Collective::Tcp(TcpGroup::host(&listener, 2).unwrap()),
        1024.0,
    );
    let (one, one_weights) = other.join().unwrap();
    assert!(root[0].skipped && one[0].skipped, "{root:?} / {one:?}");
    // Each rank halves its own scale; rank 1's still overflows, so both skip again.
    assert!(root[1].skipped && one[1].skipped, "{root:?} / {one:?}");
    assert_eq!(
        (root[1].loss_scale, one[1].loss_scale),
        (256.0, 2f64.powi(38))
    );
    assert_eq!(
        root[0].loss, one[0].loss,
        "the reported loss is the global mean"
    );
    assert!(bits(&root_weights) == bits(&one_weights));
}

/// `autotune ARGS --json` in `dir`; its JSON document.
fn json_of(dir: &Path, args: &[&str]) -> Value {
    let mut argv = args.to_vec();
    argv.push("--json");
    document_of(dir, &argv)
}

/// `autotune ARGS` in `dir`, which must succeed and print one JSON document.
fn document_of(dir: &Path, argv: &[&str]) -> Value {
    let out = autotune_in(dir, argv);
    assert_eq!(out.status.code(), Some(0), "{argv:?}: {}", stderr(&out));
    serde_json::from_str(&stdout(&out)).expect("stdout is one JSON document")
}

#[test]
fn launched_ranks_leave_the_checkpoint_one_process_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let common = [
        "train",
        "--device",
        "cpu",
        "--steps",
        "3",
        "--micro-batch",
        "4",
    ];
    let dp = json_of(
        dir.path(),
        &[
            &common[..],
            &["--data-parallel", "2", "--checkpoint-dir", "dp"],
            &["--lr-warmup-steps", "2", "--metrics", "dp.jsonl"],
        ]
        .concat(),
    );
    let one = json_of(
        dir.path(),
        &[
            &common[..],
            &["--grad-accum", "2", "--checkpoint-dir", "one"],
            &["--lr-warmup-steps", "2", "--metrics", "one.jsonl"],
        ]
        .concat(),
    );
    assert_eq!(dp["last_loss"], one["last_loss"]);
    // The launcher logs rank 0's steps: the single process's steps, rates and losses.
    let log = |name: &str| -> Vec<Value> {
        std::fs::read_to_string(dir.path().join(name))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let (dp_log, one_log) = (log("dp.jsonl"), log("one.jsonl"));
    assert_eq!(dp_log.len(), 3);
    for (a, b) in dp_log.iter().zip(&one_log) {
        for field in ["step", "lr", "loss"] {
            assert_eq!(a[field], b[field], "{field}");
        }
    }
    assert_eq!(dp["knobs"]["data_parallel"]["degree"], 2);
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let read =
            |run: &str| std::fs::read(dir.path().join(run).join("step-000003").join(file)).unwrap();
        assert!(read("dp") == read("one"), "{file} differs");
    }
    // Resuming the data-parallel run continues it: two more steps on two ranks.
    let resumed = json_of(
        dir.path(),
        &[
            &common[..3],
            &["--steps", "5", "--micro-batch", "4", "--data-parallel", "2"],
            &["--checkpoint-dir", "dp", "--resume"],
            &["--lr-warmup-steps", "2", "--metrics", "dp.jsonl"],
        ]
        .concat(),
    );
    let straight = json_of(
        dir.path(),
        &[
            &common[..3],
            &["--steps", "5", "--micro-batch", "4", "--grad-accum", "2"],
            &["--lr-warmup-steps", "2"],
        ]
        .concat(),
    );
    assert_eq!(resumed["steps"], 5);
    assert_eq!(resumed["last_loss"], straight["last_loss"]);
    let dp_log = log("dp.jsonl");
    assert_eq!(dp_log.len(), 5, "the resumed launch continues the log");
    assert_eq!(dp_log[4]["loss"], straight["last_loss"]);
}

/// Starts a long launched run; its stderr lines arrive on the receiver.
fn start_long_run(dir: &Path) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    start_long_run_with(dir, &[])
}

/// [`start_long_run`] with `extra` arguments.
fn start_long_run_with(
    dir: &Path,
    extra: &[&str],
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_autotune"))
        .current_dir(dir)
        .args([
            "train",
            "--device",
            "cpu",
            "--steps",
            "100000",
            "--micro-batch",
            "2",
            "--data-parallel",
            "2",
            "--checkpoint-dir",
            "ckpt",
            "--checkpoint-every",
            "100000",
        ])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Reads lines until one contains `needle`; all lines read so far.
fn read_until(rx: &std::sync::mpsc::Receiver<String>, needle: &str, seen: &mut Vec<String>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(100)) {
            let found = line.contains(needle);
            seen.push(line);
            if found {
                return;
            }
        }
    }
    panic!("no line with `{needle}` within a minute: {seen:#?}");
}

fn wait_with_timeout(child: &mut std::process::Child) -> Option<i32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    panic!("the launcher did not exit within a minute");
}

fn signal(pid: &str, sig: &str) {
    let ok = Command::new("kill").args([sig, pid]).status().unwrap();
    assert!(ok.success(), "kill {sig} {pid}");
}

#[test]
fn a_dead_rank_ends_the_launch_with_exit_2_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (mut launcher, rx) = start_long_run(dir.path());
    let mut seen = Vec::new();
    read_until(&rx, "rank 1: started, pid", &mut seen);
    let pid = seen.last().unwrap().rsplit(' ').next().unwrap().to_string();
    // Once rank 0 has taken a step, the ranks have met: the rank dies mid-run.
    read_until(&rx, "step 1:", &mut seen);
    signal(&pid, "-9");
    assert_eq!(wait_with_timeout(&mut launcher), Some(2), "{seen:#?}");
    let rest: Vec<String> = rx.try_iter().collect();
    let text = [seen, rest].concat().join("\n");
    assert!(
        text.contains("data-parallel training failed: rank 1 was killed")
            && text.contains("the other ranks were stopped"),
        "{text}"
    );
}

#[test]
fn an_interrupt_reaches_every_rank_which_checkpoint_and_stop_together() {
    let dir = tempfile::tempdir().unwrap();
    let (mut launcher, rx) = start_long_run(dir.path());
    let mut seen = Vec::new();
    read_until(&rx, "rank 1: started", &mut seen);
    read_until(&rx, "step 1:", &mut seen);
    // Only the launcher gets the signal; it forwards the interrupt to its ranks.
    signal(&launcher.id().to_string(), "-INT");
    assert_eq!(wait_with_timeout(&mut launcher), Some(130), "{seen:#?}");
    let latest = std::fs::read_to_string(dir.path().join("ckpt").join("latest")).unwrap();
    assert!(latest.starts_with("step-"), "{latest}");
}

#[test]
fn data_cut_short_under_one_rank_stops_every_rank_at_one_step_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("tokens.bin");
    token_file(&data, 200_000);
    let (mut launcher, rx) = start_long_run_with(dir.path(), &["--data", "tokens.bin"]);
    let mut seen = Vec::new();
    read_until(&rx, "rank 1: started", &mut seen);
    read_until(&rx, "step 1:", &mut seen);
    // Emptied: whichever window a rank reads next lies past the end.
    empty_in_place(&data);
    assert_eq!(wait_with_timeout(&mut launcher), Some(2), "{seen:#?}");
    let rest: Vec<String> = rx.try_iter().collect();
    let text = [seen, rest].concat().join("\n");
    assert!(text.contains("changed while the run read it"), "{text}");
    let ckpt = dir.path().join("ckpt");
    let latest = std::fs::read_to_string(ckpt.join("latest")).expect("a checkpoint was saved");
    assert!(text.contains(latest.trim()), "the error names it: {text}");
    autotune::train::checkpoint::verify(&ckpt.join(latest.trim())).unwrap();
}

#[test]
fn bad_data_parallel_flags_exit_2_naming_the_flag_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let two_gpus = r#"{"name": "two-gpus", "kind": "cuda", "gpu_memory_bytes": 25757220864,
        "gpu_count": 2, "host_memory_bytes": 34359738368}"#;
    std::fs::write(dir.path().join("two-gpus.json"), two_gpus).unwrap();
    let cases: [(&[&str], &[&str]); 5] = [
        (
            &["train", "--shard-optimizer"],
            &["`--shard-optimizer`", "--data-parallel N"],
        ),
        (
            &["train", "--data-parallel", "0"],
            &["`--data-parallel 0`", "use 1 or more"],
        ),
        (
            &["train", "--device", "cuda", "--data-parallel", "2"],
            &["--data-parallel", "asks for 2 GPUs but 0 are visible"],
        ),
        (
            &["tune", "--target", "two-gpus.json", "--data-parallel", "4"],
            &["--data-parallel", "gpu_count (2)"],
        ),
        (
            &["tune", "--target", "two-gpus.json", "--global-batch", "7"],
            &["--global-batch", "multiple of 2"],
        ),
    ];
    for (args, needles) in cases {
        let out = autotune_in(dir.path(), args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        for needle in needles {
            assert!(stderr(&out).contains(needle), "{args:?}: {}", stderr(&out));
        }
    }
}

/// A data-parallel plan made from a recorded single-GPU plan: the same per-GPU setting on four
/// GPUs with a sharded optimizer (what a search on a four-GPU host writes).
fn data_parallel_plan(dir: &Path) -> std::path::PathBuf {
    let recording = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("profiles/recorded/rtx4090-32g-on-h200/seed.json");
    let backend = format!("replay:{}", recording.display());
    let out = autotune(&["tune", "--backend", &backend, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let mut plan: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(plan["schema_version"], 1);
    let knobs = &plan["knobs"];
    let per_gpu = knobs["micro_batch"].as_u64().unwrap() * knobs["grad_accum"].as_u64().unwrap();
    plan["schema_version"] = 2.into();
    plan["device"]["gpu_count"] = 4.into();
    plan["knobs"]["data_parallel"] = serde_json::json!({"degree": 4, "shard_optimizer": true});
    plan["data_parallel"] = serde_json::json!({
        "degree": 4, "shard_optimizer": true, "global_batch": per_gpu * 4,
        "single_gpu_tokens_per_s": null, "scaling_efficiency": null,
    });
    let path = dir.join("dp-plan.json");
    std::fs::write(&path, plan.to_string()).unwrap();
    path
}

#[test]
fn the_exports_carry_the_data_parallel_layout() {
    let dir = tempfile::tempdir().unwrap();
    let plan = data_parallel_plan(dir.path());
    let plan = plan.to_str().unwrap();
    let export = |format: &str, extra: &[&str]| {
        let mut argv = vec!["export", "--plan", plan, "--format", format];
        argv.extend_from_slice(extra);
        argv.push("--allow-engine-mismatch");
        document_of(dir.path(), &argv)
    };
    let ds = export("deepspeed", &[]);
    let per_gpu = ds["train_micro_batch_size_per_gpu"].as_u64().unwrap()
        * ds["gradient_accumulation_steps"].as_u64().unwrap();
    assert_eq!(ds["train_batch_size"].as_u64().unwrap(), 4 * per_gpu);
    assert_eq!(ds["zero_optimization"], serde_json::json!({"stage": 1}));
    // A cluster of four such hosts keeps the per-GPU setting.
    let cluster = export("deepspeed", &["--world-size", "16"]);
    assert_eq!(cluster["train_batch_size"].as_u64().unwrap(), 16 * per_gpu);
    // The Trainer shards through DeepSpeed's file; Lightning names the devices.
    assert_eq!(export("trainer", &[])["deepspeed"], "ds_config.json");
    let lightning = export("lightning", &[]);
    assert_eq!(lightning["devices"], 4);
    assert_eq!(lightning["strategy"], "deepspeed_stage_1");
    // Training it here needs four GPUs; the error names the plan field.
    let out = autotune_in(dir.path(), &["train", "--plan", plan, "--steps", "1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("knobs.data_parallel.degree")
            && stderr(&out).contains("asks for 4 GPUs"),
        "{}",
        stderr(&out)
    );
}

/// A model big enough that its Adam moments dominate the host heap of a CPU trial.
const WIDE: &str = r#"{"preset": "tiny", "name": "wide", "d_model": 256, "n_heads": 4, "d_ff": 1024, "seq_len": 16}"#;

fn probe(dir: &Path, extra: &[&str]) -> Value {
    let args = [
        &[
            "probe",
            "--model",
            "wide.json",
            "--device",
            "cpu",
            "--micro-batch",
            "1",
        ][..],
        &["--warmup", "1", "--steps", "2"],
        extra,
    ]
    .concat();
    json_of(dir, &args)
}

#[test]
fn a_data_parallel_probe_measures_every_rank_and_sharding_saves_their_memory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("wide.json"), WIDE).unwrap();
    let params = ModelSpec::resolve(dir.path().join("wide.json").to_str().unwrap())
        .unwrap()
        .parameter_count() as f64;
    let one = probe(dir.path(), &[]);
    let two = probe(dir.path(), &["--data-parallel", "2"]);
    let sharded = probe(dir.path(), &["--data-parallel", "2", "--shard-optimizer"]);
    for p in [&one, &two, &sharded] {
        assert_eq!(p["outcome"], "fits", "{p}");
    }
    let host = |p: &Value| p["peak_host_bytes"].as_f64().unwrap();
    // Two ranks hold two models and two optimizers on this host.
    assert!(
        host(&two) > 1.5 * host(&one),
        "{} vs {}",
        host(&two),
        host(&one)
    );
    // Each sharded rank keeps half of the moments (8 bytes per parameter): about 8·P less in
    // all; at least half of that must show.
    let saved = host(&two) - host(&sharded);
    assert!(
        saved > 4.0 * params,
        "saved {saved} bytes for {params} parameters"
    );
    assert_eq!(two["request"]["knobs"]["data_parallel"]["degree"], 2);
    assert!(two["tokens_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn a_launcher_tokenizes_a_dataset_once_and_its_ranks_read_its_cache() {
    let dir = tempfile::tempdir().unwrap();
    let folder = crate::fine_tune::chat_model(dir.path());
    let lines: Vec<String> = (0..16)
        .map(|i| {
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("Say {i}.")},
                {"role": "assistant", "content": format!("{i}")},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(dir.path().join("chat.jsonl"), lines.join("\n")).unwrap();
    let out = autotune_in(
        dir.path(),
        &[
            "train",
            "--model",
            folder.to_str().unwrap(),
            "--device",
            "cpu",
            "--data",
            "chat.jsonl",
            "--data-parallel",
            "2",
            "--micro-batch",
            "2",
            "--steps",
            "2",
            "--cache-dir",
            "cache",
        ],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(err.matches("tokenizing 16 records").count(), 1, "{err}");
    // Before the ranks start: they map what the launcher cached.
    let tokenized = err.find("tokenizing 16 records").unwrap();
    let launched = err.find("data parallel: 2 ranks").unwrap();
    assert!(tokenized < launched, "{err}");
    let cached = std::fs::read_dir(dir.path().join("cache")).unwrap().count();
    assert_eq!(cached, 1, "one cache entry, written once");
}
