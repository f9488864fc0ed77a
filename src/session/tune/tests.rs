use std::cell::RefCell;
use std::path::PathBuf;

use super::*;
use crate::probe::timeout::TrialTimeout;
use crate::search::report::Event;
use crate::search::setup::{Runtime, SearchSetup};
use crate::search::space::SpaceRequest;
use crate::settings::tune::ProbeIsolation;
use crate::spec::budget::Budget;

/// Everything a session told its caller, in order.
#[derive(Default)]
struct Told {
    lines: RefCell<Vec<String>>,
}

impl TuneObserver for Told {
    fn replaying(&self, path: &Path, profile: &Profile) {
        let line = format!("replaying {} from {}", profile.model.name, path.display());
        self.lines.borrow_mut().push(line);
    }

    fn tuning(&self, settings: &LiveSettings) {
        let line = format!("tuning {}", settings.spec.name);
        self.lines.borrow_mut().push(line);
    }

    fn runner_starting(&self, _group: RunningGroup) {
        self.lines.borrow_mut().push("runner".into());
    }

    fn edge_trial(&self, tokens: usize, _result: &TrialResult, _fits: bool) {
        self.lines.borrow_mut().push(format!("edge {tokens}"));
    }

    fn search_progress(&self) -> Box<dyn Reporter + '_> {
        self.lines.borrow_mut().push("search".into());
        Box::new(|event: &Event| {
            if let Event::TrialFinished { index, .. } = event {
                self.lines.borrow_mut().push(format!("trial {index}"));
            }
        })
    }
}

fn recording() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles/recorded/rtx4090-32g-on-h200/seed.json")
}

#[test]
fn a_replay_tells_what_it_replays_then_each_trial_and_records_its_facts_whole() {
    let path = recording();
    let profile = Profile::load(&path).unwrap();
    let settings = TuneSettings {
        source: Source::Replay {
            path: path.clone(),
            profile: Box::new(profile.clone()),
        },
        record: None,
        out: None,
        report: None,
        notes: Vec::new(),
    };
    let told = Told::default();
    let tuned = tune(&settings, &told).unwrap();
    let lines = told.lines.into_inner();
    assert_eq!(
        lines[..2],
        [
            format!("replaying seed from {}", path.display()),
            "search".into()
        ]
    );
    assert_eq!(lines.len(), 2 + tuned.outcome.history.len());
    assert_eq!(tuned.plan.as_ref().map(|p| p.knobs), profile.chosen);
    let recorded = tuned.record();
    assert_eq!(
        (&recorded.space, &recorded.facts),
        (&profile.space, &profile.facts)
    );
}

#[test]
fn a_model_whose_state_cannot_fit_is_answered_without_a_trial() {
    let spec = ModelSpec::preset("llama-3.1-8b").unwrap();
    let target = DeviceSpec::builtin("cpu").unwrap();
    let budget = Budget::from_device(&target);
    let runtime = Runtime {
        flash_head_dims: &[],
        host_adam_floor_s: &|_| None,
        own_engine: true,
    };
    let setup =
        SearchSetup::resolve(&spec, &target, &budget, &SpaceRequest::default(), &runtime).unwrap();
    let settings = LiveSettings {
        spec,
        target,
        budget,
        space: setup.space,
        facts: setup.facts,
        isolation: ProbeIsolation::InProcess,
        trial_timeout: TrialTimeout::scaled(),
        runner: None,
        data: None,
        model_folder: None,
        edge_trials: 0,
        notes: Vec::new(),
    };
    let told = Told::default();
    let tuned = live(&settings, &told).unwrap();
    assert_eq!(told.lines.into_inner(), ["tuning llama-3.1-8b"]);
    assert!(tuned.plan.is_none() && tuned.outcome.history.is_empty());
    assert!(
        matches!(&tuned.outcome.decision, Decision::NoFeasible { hint } if hint.contains("parameters")),
        "{:?}",
        tuned.outcome.decision
    );
}
