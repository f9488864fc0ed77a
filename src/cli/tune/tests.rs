use autotune::settings::tune::Source;

use super::*;

#[test]
fn a_recording_that_cannot_be_written_does_not_cost_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let recording = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("profiles/recorded/rtx4090-32g-on-h200/seed.json");
    let plan = dir.path().join("plan.json");
    // Under a file: no directory can be made there.
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, b"x").unwrap();
    let settings = TuneSettings {
        source: Source::Replay {
            path: recording.clone(),
            profile: Box::new(Profile::load(&recording).unwrap()),
        },
        record: Some(blocker.join("profile.json")),
        out: Some(plan.clone()),
        report: None,
        notes: Vec::new(),
    };
    let quiet = Printer::new(true, false, false);
    let Err(err) = run_settings(&settings, &quiet) else {
        panic!("a recording that cannot be written is an error");
    };
    assert!(err.to_string().contains("profile"), "{err}");
    autotune::plan::schema::Plan::load(&plan).expect("the plan was written first");
}
