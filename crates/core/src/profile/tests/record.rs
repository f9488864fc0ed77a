//! Profile files: round trip, atomic save, and errors that name the file and the problem.

use std::path::Path;

use super::*;
use crate::plan::Plan;
use crate::profile::record::{PROFILE_KIND, PROFILE_SCHEMA_VERSION, RECORDED_DIR};
use crate::Error;

/// The error's whole chain as the CLI prints it.
fn chain(err: &Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// Writes `text` to `name` in `dir` and loads it, expecting an error that names the file.
fn load_error(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    let err = Profile::load(&path).unwrap_err();
    assert!(
        matches!(&err, Error::File { path: p, .. } if p == &path),
        "{err:?}"
    );
    let message = chain(&err);
    assert!(message.contains(name), "{message}");
    message
}

#[test]
fn from_search_records_everything() {
    let (driver, _, outcome, profile) = recorded(spaces().remove(0));
    assert_eq!(profile.schema_version, PROFILE_SCHEMA_VERSION);
    assert_eq!(profile.kind, PROFILE_KIND);
    assert_eq!(profile.candle_version, CANDLE_VERSION);
    assert_eq!(profile.tool.version, env!("CARGO_PKG_VERSION"));
    assert_eq!(profile.trials, outcome.history);
    assert_eq!(profile.chosen, outcome.chosen());
    assert!(profile.chosen.is_some());
    assert_eq!(profile.budget, *driver.budget());
    assert_eq!(&profile.space, driver.space());
    assert_eq!(&profile.facts, driver.facts());
    profile.validate().unwrap();
}

/// Facts a GPU search knows: the host floor, the link, a memory law per regime, and what
/// accumulation adds.
fn gpu_facts() -> MachineFacts {
    let law = crate::spec::activations::MemoryLaw {
        fixed_bytes: 3.0e9,
        per_sequence_bytes: 2.5e8,
    };
    let extra = crate::search::AccumulationExtra {
        micro_batch: 2,
        bytes: 5.5e9,
    };
    MachineFacts {
        offload_host_floor_s: Some(0.07),
        target_link_gbps: Some(25.0),
        memory_prior: vec![law; 2],
        accumulation_extra: vec![vec![extra], Vec::new()],
    }
}

#[test]
fn the_facts_are_recorded_whole_and_replay_without_patching() {
    let (driver, _, _, profile) = recorded_with(spaces().remove(0), gpu_facts());
    let back = Profile::from_json(&profile.to_json()).unwrap();
    assert_eq!(back.facts, gpu_facts());
    let value: serde_json::Value = serde_json::from_str(&profile.to_json()).unwrap();
    assert_eq!(value["facts"]["target_link_gbps"], 25.0);
    assert!(value["space"].get("target_link_gbps").is_none());
    let replayed = back.driver().unwrap();
    assert_eq!(
        (replayed.space(), replayed.facts()),
        (driver.space(), driver.facts())
    );
}

/// A version 1 profile kept the machine's facts inside `space`: it loads with them in `facts`,
/// as the version 2 profile of the same search, and a space that keeps none has none.
#[test]
fn a_version_1_profile_loads_with_its_facts_moved_out_of_the_space() {
    // Version 1 knew no accumulation facts.
    let version_1_facts = MachineFacts {
        accumulation_extra: Vec::new(),
        ..gpu_facts()
    };
    for facts in [version_1_facts, MachineFacts::default()] {
        let (_, _, _, profile) = recorded_with(spaces().remove(0), facts.clone());
        let mut v1 = serde_json::to_value(&profile).unwrap();
        let object = v1.as_object_mut().unwrap();
        object.insert("schema_version".into(), 1.into());
        let moved = object.remove("facts").unwrap();
        for (field, fact) in moved.as_object().unwrap() {
            object["space"][field.as_str()] = fact.clone();
        }
        let loaded = Profile::from_json(&v1.to_string()).unwrap();
        assert_eq!(loaded.facts, facts);
        assert_eq!(loaded.space, profile.space);
        assert_eq!(loaded, profile);
    }
}

#[test]
fn a_version_1_profile_with_version_2_fields_is_refused() {
    let (_, _, _, profile) = recorded_with(spaces().remove(0), gpu_facts());
    let dir = tempfile::tempdir().unwrap();
    let mut v1 = serde_json::to_value(&profile).unwrap();
    v1["schema_version"] = 1.into();
    let message = load_error(dir.path(), "mixed.json", &v1.to_string());
    assert!(message.contains("`facts`"), "{message}");
    // Version 2 keeps the space free of facts.
    let mut v2 = serde_json::to_value(&profile).unwrap();
    v2["space"]["target_link_gbps"] = 25.0.into();
    let message = load_error(dir.path(), "v2.json", &v2.to_string());
    assert!(
        message.contains("unknown field `target_link_gbps`"),
        "{message}"
    );
}

#[test]
fn save_and_load_round_trip() {
    let (_, _, _, profile) = recorded(spaces().remove(1));
    let dir = tempfile::tempdir().unwrap();
    let path = profile.default_path(dir.path());
    assert_eq!(
        path,
        dir.path()
            .join(RECORDED_DIR)
            .join("rtx4090-32g")
            .join("gpt-124m.json")
    );
    // The directory is created on save.
    profile.save(&path).unwrap();
    let loaded = Profile::load(&path).unwrap();
    assert_eq!(loaded.trials.len(), profile.trials.len());
    for (a, b) in loaded.trials.iter().zip(&profile.trials) {
        assert_eq!(a.request, b.request);
        match (a.outcome.measurement(), b.outcome.measurement()) {
            (Some(x), Some(y)) => {
                // serde_json may parse a float one unit in the last place off.
                assert_eq!(x.peak_gpu_bytes, y.peak_gpu_bytes);
                assert!((x.tokens_per_s - y.tokens_per_s).abs() <= 1e-12 * y.tokens_per_s);
            }
            (None, None) => assert_eq!(a.outcome, b.outcome),
            _ => panic!("outcomes differ: {:?} vs {:?}", a.outcome, b.outcome),
        }
    }
    assert_eq!(
        (&loaded.device, &loaded.model, loaded.chosen),
        (&profile.device, &profile.model, profile.chosen)
    );
    // Saving again replaces the file and leaves no temporary file behind.
    profile.save(&path).unwrap();
    let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("gpt-124m.json")]);
}

#[test]
fn a_truncated_file_is_named_and_called_truncated() {
    let (_, _, _, profile) = recorded(spaces().remove(0));
    let dir = tempfile::tempdir().unwrap();
    let json = profile.to_json();
    let message = load_error(dir.path(), "cut.json", &json[..json.len() / 2]);
    assert!(message.contains("truncated"), "{message}");
}

#[test]
fn foreign_json_is_refused_as_not_a_profile() {
    let dir = tempfile::tempdir().unwrap();
    let message = load_error(dir.path(), "hello.json", r#"{"hello": 1}"#);
    assert!(
        message.contains("not an autotune profile") && message.contains("kind"),
        "{message}"
    );
    let message = load_error(dir.path(), "list.json", "[1, 2]");
    assert!(message.contains("JSON object"), "{message}");

    // A plan is recognised as such.
    let (driver, _, outcome, _) = recorded(spaces().remove(0));
    let plan = Plan::from_search(&driver, &outcome, &model(), &device_profile(), CREATED).unwrap();
    let message = load_error(dir.path(), "plan.json", &plan.to_json());
    assert!(
        message.contains("not an autotune profile") && message.contains("plan"),
        "{message}"
    );
}

#[test]
fn other_versions_and_bad_fields_are_named() {
    let (_, _, _, profile) = recorded(spaces().remove(0));
    let dir = tempfile::tempdir().unwrap();
    let edited = |f: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| {
        let mut value = serde_json::to_value(&profile).unwrap();
        f(value.as_object_mut().unwrap());
        value.to_string()
    };

    let v3 = edited(&|o| {
        o.insert("schema_version".into(), 3.into());
    });
    let message = load_error(dir.path(), "v3.json", &v3);
    assert!(
        message.contains("schema_version") && message.contains("is 3"),
        "{message}"
    );

    let no_model = edited(&|o| {
        o.remove("model");
    });
    let message = load_error(dir.path(), "no-model.json", &no_model);
    assert!(message.contains("missing field `model`"), "{message}");

    let extra = edited(&|o| {
        o.insert("gpu".into(), 1.into());
    });
    let message = load_error(dir.path(), "extra.json", &extra);
    assert!(message.contains("unknown field `gpu`"), "{message}");

    let cpu_budget = edited(&|o| {
        o["budget"]["gpu_bytes"] = serde_json::Value::Null;
    });
    let message = load_error(dir.path(), "cpu-budget.json", &cpu_budget);
    assert!(message.contains("budget.gpu_bytes"), "{message}");
}

#[test]
fn a_missing_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent.json");
    let err = Profile::load(&path).unwrap_err();
    assert!(matches!(&err, Error::File { path: p, .. } if p == &path));
    assert!(chain(&err).contains("cannot read profile"));
}

#[test]
fn a_runners_engine_is_recorded_read_back_and_kept_apart_from_ours() {
    let (_, _, _, ours) = recorded(spaces().remove(0));
    assert_eq!(ours.engine_name(), "autotune");
    assert!(
        !ours.to_json().contains("\"engine\""),
        "absent for our engine"
    );
    let theirs = ours.clone().measured_by("pytorch", Some("2.11.0"));
    assert_eq!(theirs.engine_name(), "pytorch");
    let back = Profile::from_json(&theirs.to_json()).unwrap();
    assert_eq!(back, theirs);
    assert_eq!(back.engine_version.as_deref(), Some("2.11.0"));
    let why = ours
        .setup_differs(&theirs)
        .expect("two engines do not compare");
    assert!(why.contains("pytorch") && why.contains("autotune"), "{why}");
    assert_eq!(theirs.setup_differs(&back), None);

    let dir = tempfile::tempdir().unwrap();
    let unnamed = ours.measured_by(" ", None).to_json();
    let message = load_error(dir.path(), "unnamed.json", &unnamed);
    assert!(message.contains("`engine`"), "{message}");
}
