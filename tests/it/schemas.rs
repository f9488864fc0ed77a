//! The published plan schema (`docs/plan.schema.json`): every plan autotune writes follows it,
//! and what autotune's own reader refuses, it refuses too.

use std::path::Path;

use serde_json::{json, Value};

use autotune::plan::Plan;

use crate::util::{autotune_in, published_schema, schema_violations, stderr, stdout};

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// `tune ARGS --json` in `dir`: the plan it prints.
fn tuned(dir: &Path, args: &[&str]) -> Value {
    let mut argv = vec!["tune"];
    argv.extend_from_slice(args);
    argv.push("--json");
    let out = autotune_in(dir, &argv);
    assert_eq!(out.status.code(), Some(0), "{argv:?}: {}", stderr(&out));
    serde_json::from_str(&stdout(&out)).unwrap()
}

/// Plans of every kind autotune writes: a live CPU search, one tuned on a dataset from a model
/// folder, a replay of every committed GPU recording (offload, checkpointing, the update in backward, host links), and a version 2
/// data-parallel plan.
fn written_plans(dir: &Path) -> Vec<(String, Value)> {
    let mut plans = vec![(
        "live cpu".to_string(),
        tuned(
            dir,
            &[
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--max-micro-batch",
                "4",
                "--timed-steps",
                "1",
                "--warmup-steps",
                "0",
            ],
        ),
    )];
    // Tuned on a dataset of conversations from a model folder.
    let folder = crate::fine_tune::chat_model(dir);
    let line = json!({"messages": [
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."},
    ]});
    std::fs::write(dir.join("chat.jsonl"), format!("{line}\n{line}\n")).unwrap();
    plans.push((
        "tuned on data".to_string(),
        tuned(
            dir,
            &[
                "--model",
                &folder.to_string_lossy(),
                "--target",
                "cpu",
                "--data",
                "chat.jsonl",
                "--max-trials",
                "2",
            ],
        ),
    ));
    let mut recordings = Vec::new();
    let mut pending = vec![repo("profiles/recorded")];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else {
                recordings.push(path);
            }
        }
    }
    assert!(recordings.len() >= 10);
    for recording in recordings {
        let backend = format!("replay:{}", recording.display());
        plans.push((
            recording.display().to_string(),
            tuned(dir, &["--backend", &backend]),
        ));
    }
    // The same per-GPU setting on four GPUs with a sharded optimizer, as a search on a
    // four-GPU host writes it; autotune's reader checks it is one.
    let seed = plans
        .iter()
        .find(|(what, _)| what.ends_with("rtx4090-32g-on-h200/seed.json"))
        .expect("the seed recording's plan");
    let mut dp = seed.1.clone();
    let per_gpu =
        dp["knobs"]["micro_batch"].as_u64().unwrap() * dp["knobs"]["grad_accum"].as_u64().unwrap();
    dp["schema_version"] = 2.into();
    dp["device"]["gpu_count"] = 4.into();
    dp["knobs"]["data_parallel"] = json!({"degree": 4, "shard_optimizer": true});
    dp["data_parallel"] = json!({
        "degree": 4, "shard_optimizer": true, "global_batch": per_gpu * 4,
        "single_gpu_tokens_per_s": 1000.0, "scaling_efficiency": 0.9,
    });
    Plan::from_json(&dp.to_string()).expect("a valid version 2 plan");
    plans.push(("data parallel".to_string(), dp));
    plans
}

#[test]
fn every_plan_autotune_writes_follows_the_published_schema() {
    let dir = tempfile::tempdir().unwrap();
    let schema = published_schema("plan.schema.json");
    let plans = written_plans(dir.path());
    for (what, plan) in &plans {
        assert_eq!(
            schema_violations(&schema, plan),
            Vec::<String>::new(),
            "{what}"
        );
    }
    // The replays cover what the schema's variants describe.
    let text = serde_json::to_string(&plans.iter().map(|(_, p)| p).collect::<Vec<_>>()).unwrap();
    for covered in [
        "\"in_backward\"",
        "\"every_kth\"",
        "\"optimizer\"",
        "\"host_link\"",
        "\"out_of_memory\"",
        "\"fits\"",
        "\"provenance\"",
        "\"model_folder\"",
        "\"fingerprint\"",
    ] {
        assert!(text.contains(covered), "no written plan has {covered}");
    }
}

/// A change that makes a plan invalid.
type Damage = Box<dyn Fn(&mut Value)>;

#[test]
fn what_the_plan_reader_refuses_the_schema_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let schema = published_schema("plan.schema.json");
    // The seed recording's plan: its first trial fits, so a field added to it is one the
    // reader must refuse.
    let (_, plan) = written_plans(dir.path())
        .into_iter()
        .find(|(what, _)| what.ends_with("rtx4090-32g-on-h200/seed.json"))
        .expect("the seed recording's plan");
    let broken: [(&str, Damage); 9] = [
        ("an unknown field", Box::new(|p| p["extra"] = 1.into())),
        (
            "another version",
            Box::new(|p| p["schema_version"] = 3.into()),
        ),
        (
            "a missing field",
            Box::new(|p| {
                p.as_object_mut().unwrap().remove("evidence");
            }),
        ),
        (
            "an unknown precision",
            Box::new(|p| p["knobs"]["precision"] = "fp4".into()),
        ),
        (
            "a micro-batch of 0",
            Box::new(|p| p["knobs"]["micro_batch"] = 0.into()),
        ),
        (
            "version 2 without its layout",
            Box::new(|p| p["schema_version"] = 2.into()),
        ),
        (
            "an unknown field in a trial",
            Box::new(|p| p["evidence"][0]["spare"] = 1.into()),
        ),
        (
            "an unknown outcome",
            Box::new(|p| p["evidence"][0]["outcome"] = "exploded".into()),
        ),
        (
            "checkpointing without its k",
            Box::new(|p| p["knobs"]["checkpointing"] = json!({"mode": "every_kth"})),
        ),
    ];
    for (what, damage) in broken {
        let mut bad = plan.clone();
        damage(&mut bad);
        assert!(
            !schema_violations(&schema, &bad).is_empty(),
            "the schema accepts a plan with {what}"
        );
        assert!(
            Plan::from_json(&bad.to_string()).is_err(),
            "the reader accepts a plan with {what}"
        );
    }
}
