use std::path::Path;

use super::*;
use crate::profile::replay::ReplayProber;
use crate::search::{run_search, NoReporter};
use crate::trial::MemoryKind;

fn recorded(name: &str) -> Profile {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../profiles/recorded/rtx4090-32g-on-h200")
        .join(name);
    Profile::load(&path).unwrap()
}

/// The plan a replay of `profile` makes.
fn replayed_plan(profile: &Profile) -> Plan {
    let driver = profile.driver().unwrap();
    let mut prober = ReplayProber::new(profile.clone());
    let outcome = run_search(&driver, &mut prober, &NoReporter).unwrap();
    Plan::from_search(&driver, &outcome, &profile.model, &profile.device.target, 0)
        .expect("the recording's search chose a plan")
}

fn count(haystack: &str, needle: &str) -> usize {
    haystack.matches(needle).count()
}

#[test]
fn a_profile_shows_every_regime_with_its_charts_out_of_memory_points_and_fits() {
    let profile = recorded("gpt-1.3b.json");
    let report = Report::from_profile(&profile);
    let regimes = report.regimes();
    let mut distinct: Vec<_> = profile
        .trials
        .iter()
        .map(|t| t.request.knobs.regime())
        .collect();
    distinct.sort();
    distinct.dedup();
    assert_eq!(regimes.len(), distinct.len());
    assert_eq!(regimes.iter().filter(|r| r.chosen).count(), 1);
    let chosen = regimes.iter().find(|r| r.chosen).unwrap();
    assert_eq!(Some(chosen.regime), profile.chosen.map(|k| k.regime()));

    let html = report.to_html();
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert!(!html.contains("<script"), "no script");
    assert!(
        !html.contains("http://") || !html.contains("src="),
        "nothing to load"
    );
    assert_eq!(count(&html, "<section class=\"regime"), regimes.len());
    // On a GPU target: GPU memory, host memory and throughput per regime.
    assert_eq!(
        count(&html, "<svg class=\"chart memory gpu\""),
        regimes.len()
    );
    assert_eq!(
        count(&html, "<svg class=\"chart memory host\""),
        regimes.len()
    );
    assert_eq!(
        count(&html, "<svg class=\"chart throughput\""),
        regimes.len()
    );
    // Every GPU out-of-memory trial is a cross on its regime's GPU chart.
    let gpu_ooms = profile
        .trials
        .iter()
        .filter(|t| {
            matches!(
                t.outcome,
                Outcome::OutOfMemory {
                    memory: MemoryKind::Gpu,
                    ..
                }
            )
        })
        .count();
    assert!(gpu_ooms > 0);
    assert_eq!(count(&html, "<path class=\"oom\""), gpu_ooms);
    // Budget and headroom lines on the charts of the regimes whose peaks come near the budget
    // (every GPU chart but an offloaded regime's few small trials; the host charts of offload);
    // the others name it off the scale.
    let near_budget = |peak: fn(&crate::trial::Measurement) -> u64, budget: u64| {
        regimes
            .iter()
            .filter(|r| {
                let highest = r
                    .trials
                    .iter()
                    .filter_map(|t| t.outcome.measurement().map(peak))
                    .max()
                    .unwrap_or(0);
                highest == 0 || budget <= 4 * highest
            })
            .count()
    };
    let near_gpu_budget = near_budget(|m| m.peak_gpu_bytes, profile.budget.gpu_bytes.unwrap());
    let near_host_budget = near_budget(|m| m.peak_host_bytes, profile.budget.host_bytes);
    assert!(0 < near_host_budget && near_host_budget < regimes.len());
    assert!(near_gpu_budget > regimes.len() / 2);
    let with_lines = near_gpu_budget + near_host_budget;
    assert_eq!(count(&html, "<line class=\"budget\""), with_lines);
    assert_eq!(count(&html, "<line class=\"usable\""), with_lines);
    assert_eq!(
        count(&html, ": off the scale</text>"),
        2 * regimes.len() - with_lines
    );
    // A fitted law where two micro-batches fitted.
    let fitted = regimes.iter().filter(|r| r.fit.memory.is_some()).count();
    assert!(fitted > 0);
    assert_eq!(
        count(&html, "<polyline class=\"fit\""),
        2 * fitted + regimes.iter().filter(|r| r.fit.time.is_some()).count()
    );
    // The chosen setting: its row, and a ring on each of its regime's charts.
    assert!(html.contains(&crate::report::svg::escape(
        &profile.chosen.unwrap().to_string()
    )));
    assert_eq!(count(&html, "<circle class=\"chosen\""), 3);
    assert!(html.contains("keeps no alternatives"));
}

#[test]
fn a_plan_shows_its_prediction_errors_and_alternatives() {
    let profile = recorded("gpt-124m.json");
    let plan = replayed_plan(&profile);
    let html = Report::from_plan(&plan).to_html();
    assert!(html.contains("<table class=\"plan\">"));
    assert!(html.contains("model error (leave-one-out)"));
    if plan.alternatives.is_empty() {
        assert!(html.contains("lists no other feasible setting"));
    } else {
        let table = html.split("<table class=\"alternatives\">").nth(1).unwrap();
        let body = table.split("</table>").next().unwrap();
        assert_eq!(
            count(body, "<tr>") + count(body, "<tr class"),
            plan.alternatives.len() + 1
        );
    }
    // After a search, the report has the profile's trials and the plan's choice.
    let both = Report::from_search(&profile, Some(&plan));
    assert_eq!(both.trials.len(), profile.trials.len());
    assert_eq!(both.chosen, Some(plan.knobs));
    assert!(both.choice.is_some());
}

#[test]
fn nothing_feasible_and_odd_names_still_make_a_safe_page() {
    let mut profile = recorded("seed.json");
    profile.chosen = None;
    profile.model.name = "<img src=x onerror=alert(1)>".into();
    let report = Report::from_profile(&profile);
    let html = report.to_html();
    assert!(html.contains("id=\"no-plan\""));
    assert!(!html.contains("<img"), "names are escaped");
    assert!(html.contains("&lt;img src=x"));
    assert_eq!(count(&html, "<circle class=\"chosen\""), 0);
}

#[test]
fn a_plan_tuned_on_data_shows_where_its_sequence_and_longest_sequence_fall() {
    use crate::plan::{length_histogram, Batching, DataProfile, LongestSequence, Truncation};
    let mut plan = replayed_plan(&recorded("gpt-124m.json"));
    let without = Report::from_plan(&plan).to_html();
    assert!(!without.contains("id=\"data\""), "no data, no section");
    plan.data = Some(DataProfile {
        fingerprint: "ab".repeat(32),
        files: vec!["chat <1>.jsonl".into()],
        batching: Batching::Padded,
        truncation: Truncation::Cut,
        sequence_tokens: 1023,
        examples: 4,
        tokens: 2000,
        trained_tokens: 900,
        truncated: 2,
        dropped: 0,
        longest: 1024,
        lengths: length_histogram([300, 600, 1500, 3000]),
        fill: 0.7,
    });
    plan.longest_sequence = Some(LongestSequence {
        predicted_tokens: Some(2100),
        measured_tokens: Some(2048),
        exceeded_tokens: None,
        trials: Vec::new(),
        note: None,
    });
    let html = Report::from_plan(&plan).to_html();
    let section = &html[html.find("id=\"data\"").unwrap()..];
    let section = &section[..section.find("</section>").unwrap()];
    assert!(
        section.contains("chat &lt;1&gt;.jsonl"),
        "escaped: {section}"
    );
    assert!(section.contains("30.0% of the positions"), "{section}");
    // 300 and 600 within the sequence; 1500 beyond it but within one sequence's reach; 3000
    // beyond both.
    assert_eq!(count(section, "within its sequence"), 2, "{section}");
    assert_eq!(count(section, "though one sequence of this length fits"), 1);
    assert_eq!(count(section, "beyond its sequence"), 1);
    assert!(
        section.contains("2100 tokens predicted, 2048 measured"),
        "{section}"
    );
}

#[test]
fn a_plan_lists_the_settings_accumulation_ruled_out() {
    let mut plan = replayed_plan(&recorded("gpt-124m.json"));
    assert!(!Report::from_plan(&plan)
        .to_html()
        .contains("id=\"ruled-out\""));
    let knobs = crate::knobs::Knobs {
        grad_accum: 8,
        ..plan.knobs
    };
    plan.ruled_out = vec![crate::search::AccumulationRuledOut {
        knobs,
        measured_gpu_bytes: 22 << 30,
        added_bytes: (5u64 << 30) as f64,
    }];
    let html = Report::from_plan(&plan).to_html();
    let at = html.find("id=\"ruled-out\"").expect("the section");
    let expected = format!(
        "{}: its trial peaked at 22.00 GiB, and accumulating adds about 5.00 GiB",
        knobs
    );
    assert!(html[at..].contains(&expected), "{}", &html[at..]);
}

#[test]
fn a_plan_lists_where_memory_did_not_grow_with_the_batch() {
    let mut plan = replayed_plan(&recorded("gpt-124m.json"));
    assert!(!Report::from_plan(&plan)
        .to_html()
        .contains("id=\"non-monotone\""));
    plan.non_monotone = vec![crate::fit::NonMonotone {
        regime: plan.knobs.regime(),
        smaller: 2,
        larger: 4,
        what: "the peak falls from 23.55 GiB to 22.68 GiB as the batch grows".into(),
    }];
    let html = Report::from_plan(&plan).to_html();
    let at = html.find("id=\"non-monotone\"").expect("the section");
    assert!(
        html[at..].contains("micro-batch 2 to 4: the peak falls"),
        "{}",
        &html[at..]
    );
}
