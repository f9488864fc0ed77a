//! Plan files: round trip, atomic save, and refusal of other schema versions and unknown fields.

use super::*;
use crate::plan::select::tests::sample;

/// Equal JSON up to the last bit of floats: without serde_json's `float_roundtrip` feature,
/// parsing may land one unit in the last place away from the printed value.
fn assert_json_close(a: &serde_json::Value, b: &serde_json::Value, at: &str) {
    use serde_json::Value;
    match (a, b) {
        (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!(
                (x - y).abs() <= 1e-15 * x.abs().max(y.abs()),
                "{at}: {x} != {y}"
            );
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{at}");
            for (i, (x, y)) in x.iter().zip(y).enumerate() {
                assert_json_close(x, y, &format!("{at}[{i}]"));
            }
        }
        (Value::Object(x), Value::Object(y)) => {
            assert_eq!(
                x.keys().collect::<Vec<_>>(),
                y.keys().collect::<Vec<_>>(),
                "{at}"
            );
            for (k, x) in x {
                assert_json_close(x, &y[k], &format!("{at}.{k}"));
            }
        }
        _ => assert_eq!(a, b, "{at}"),
    }
}

fn field_of(err: Error) -> String {
    match err {
        Error::InvalidSpec { field, .. } => field,
        other => panic!("expected an invalid plan, got {other:?}"),
    }
}

#[test]
fn save_and_load_round_trip() {
    let (_, _, plan) = sample();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.json");
    plan.save(&path).unwrap();
    let loaded = Plan::load(&path).unwrap();
    assert_json_close(
        &serde_json::to_value(&loaded).unwrap(),
        &serde_json::to_value(&plan).unwrap(),
        "plan",
    );
    // Saving again replaces the file and leaves no temporary file behind.
    plan.save(&path).unwrap();
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("plan.json")]);
}

#[test]
fn other_schema_versions_are_refused_clearly() {
    let (_, _, plan) = sample();
    let mut value = serde_json::to_value(&plan).unwrap();
    value["schema_version"] = 3.into();
    let err = Plan::from_json(&value.to_string()).unwrap_err();
    assert!(
        err.to_string().contains("is 3") && err.to_string().contains("only versions 1 and 2"),
        "{err}"
    );
    assert_eq!(field_of(err), "schema_version");
    value.as_object_mut().unwrap().remove("schema_version");
    assert_eq!(
        field_of(Plan::from_json(&value.to_string()).unwrap_err()),
        "schema_version"
    );
    assert_eq!(field_of(Plan::from_json("[1]").unwrap_err()), "(document)");
}

#[test]
fn unknown_and_invalid_fields_are_named() {
    let (_, _, plan) = sample();
    let mut value = serde_json::to_value(&plan).unwrap();
    value["predicted"]["peak_gpu"] = 1.into();
    assert_eq!(
        field_of(Plan::from_json(&value.to_string()).unwrap_err()),
        "predicted.peak_gpu"
    );

    let mut value = serde_json::to_value(&plan).unwrap();
    value["knobs"]["micro_batch"] = 0.into();
    assert_eq!(
        field_of(Plan::from_json(&value.to_string()).unwrap_err()),
        "knobs.micro_batch"
    );

    let mut value = serde_json::to_value(&plan).unwrap();
    value["budget"]["gpu_bytes"] = serde_json::Value::Null;
    assert_eq!(
        field_of(Plan::from_json(&value.to_string()).unwrap_err()),
        "budget.gpu_bytes"
    );
}

#[test]
fn file_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.json");
    assert!(matches!(Plan::load(&missing), Err(Error::File { path, .. }) if path == missing));
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"schema_version": 1}"#).unwrap();
    assert!(matches!(Plan::load(&bad), Err(Error::File { path, .. }) if path == bad));
    let (_, _, plan) = sample();
    // A missing directory is created; a path through a regular file cannot be.
    let into_new_dir = dir.path().join("new/dir/plan.json");
    plan.save(&into_new_dir).unwrap();
    assert_eq!(Plan::load(&into_new_dir).unwrap(), plan);
    let through_file = bad.join("plan.json");
    assert!(matches!(
        plan.save(&through_file),
        Err(Error::File { path, .. }) if path == through_file
    ));
}

#[test]
fn json_uses_the_documented_names() {
    let (_, _, plan) = sample();
    let value = serde_json::to_value(&plan).unwrap();
    let keys: Vec<&str> = value
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    for key in [
        "schema_version",
        "tool",
        "created_unix_s",
        "model",
        "device",
        "budget",
        "knobs",
        "predicted",
        "measured",
        "tokens_per_s_interval",
        "headroom",
        "evidence",
        "model_error",
        "alternatives",
    ] {
        assert!(keys.contains(&key), "missing {key}");
    }
    assert_eq!(keys.len(), 14);
    assert_eq!(value["tool"]["name"], "autotune");
    assert_eq!(value["evidence"][0]["outcome"], "fits");
    assert_eq!(
        value["knobs"]["checkpointing"],
        serde_json::json!({"mode": "every_kth", "k": 1})
    );
}

#[test]
fn single_gpu_plans_stay_version_1_and_data_parallel_ones_are_version_2() {
    let (_, _, plan) = sample();
    assert_eq!(plan.schema_version, SINGLE_GPU_SCHEMA_VERSION);
    assert!(!plan.to_json().contains("data_parallel"));

    let mut dp = plan.clone();
    dp.schema_version = SCHEMA_VERSION;
    dp.device.gpu_count = 4;
    dp.knobs.data_parallel = crate::knobs::DataParallel::replicated(4);
    dp.data_parallel = Some(DataParallelReport {
        degree: 4,
        shard_optimizer: false,
        global_batch: dp.knobs.global_batch(),
        single_gpu_tokens_per_s: Some(1000.0),
        scaling_efficiency: Some(0.9),
    });
    let back = Plan::from_json(&dp.to_json()).unwrap();
    assert_eq!(back.data_parallel, dp.data_parallel);

    // Data-parallel fields in a version-1 document, or a version-2 one without its report,
    // or more GPUs than the device has: each is refused, naming the field.
    let mut v1 = serde_json::to_value(&dp).unwrap();
    v1["schema_version"] = 1.into();
    assert_eq!(
        field_of(Plan::from_json(&v1.to_string()).unwrap_err()),
        "schema_version"
    );
    let mut missing = serde_json::to_value(&dp).unwrap();
    missing.as_object_mut().unwrap().remove("data_parallel");
    assert_eq!(
        field_of(Plan::from_json(&missing.to_string()).unwrap_err()),
        "data_parallel"
    );
    let mut small = serde_json::to_value(&dp).unwrap();
    small["device"]["gpu_count"] = 2.into();
    assert_eq!(
        field_of(Plan::from_json(&small.to_string()).unwrap_err()),
        "knobs.data_parallel.degree"
    );
}
