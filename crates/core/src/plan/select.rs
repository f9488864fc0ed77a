//! Building a [`Plan`] from a finished search.

use super::schema::{
    Alternative, DataParallelReport, Headroom, ModelError, Plan, Predicted, Tool, SCHEMA_VERSION,
    SINGLE_GPU_SCHEMA_VERSION,
};
use crate::fit::RegimeFit;
use crate::knobs::{DataParallel, Knobs};
use crate::search::decision::Candidate;
use crate::search::driver::SearchDriver;
use crate::search::run::SearchOutcome;
use crate::spec::device::DeviceSpec;
use crate::spec::model::ModelSpec;
use crate::trial::{Measurement, TrialResult};

/// At most this many alternatives are recorded.
pub const MAX_ALTERNATIVES: usize = 5;

impl Plan {
    /// The plan for a search that chose a setting; `None` when it found none (the outcome's
    /// decision then carries the hint) or when its verification trial is missing.
    ///
    /// `driver` must be the one that ran the search, `model` and `device` what it ran for;
    /// `created_unix_s` is the caller's clock (this function reads none).
    pub fn from_search(
        driver: &SearchDriver,
        outcome: &SearchOutcome,
        model: &ModelSpec,
        device: &DeviceSpec,
        created_unix_s: u64,
    ) -> Option<Plan> {
        let knobs = outcome.chosen()?;
        let measured = *outcome.verification()?.outcome.measurement()?;
        let budget = *driver.budget();
        let fit = RegimeFit::from_history(knobs.regime(), &outcome.history);
        let b = knobs.micro_batch;
        let bytes = |v: f64| (v.is_finite() && v >= 0.0).then(|| v.round() as u64);
        let predicted = Predicted {
            peak_gpu_bytes: fit
                .memory
                .as_ref()
                .filter(|_| budget.gpu_bytes.is_some())
                .and_then(|m| bytes(m.predict(b).gpu_bytes)),
            peak_host_bytes: fit
                .memory
                .as_ref()
                .and_then(|m| bytes(m.predict(b).host_bytes)),
            tokens_per_s: fit
                .time
                .map(|t| t.tokens_per_s(b, model.seq_len))
                .filter(|t| t.is_finite()),
        };
        let headroom = Headroom {
            gpu_bytes: budget
                .gpu_bytes
                .map(|g| g.saturating_sub(measured.peak_gpu_bytes)),
            host_bytes: budget.host_bytes.saturating_sub(measured.peak_host_bytes),
        };
        let model_error = ModelError {
            memory_loo_rel_error: fit.memory.as_ref().and_then(|m| m.loo_rel_error(&budget)),
            time_loo_rel_error: fit.time.and_then(|t| t.loo_rel_error),
        };
        let others: Vec<Candidate> = driver
            .candidates(&outcome.history)
            .into_iter()
            .filter(|c| c.knobs != knobs)
            .collect();
        let data_parallel =
            (!knobs.data_parallel.is_single()).then(|| scaling_report(knobs, &outcome.history));
        Some(Plan {
            schema_version: if data_parallel.is_some() {
                SCHEMA_VERSION
            } else {
                SINGLE_GPU_SCHEMA_VERSION
            },
            tool: Tool::current(),
            created_unix_s,
            model: model.clone(),
            device: device.clone(),
            budget,
            knobs,
            predicted,
            measured,
            tokens_per_s_interval: Some(interval(&measured)),
            headroom,
            evidence: outcome.history.clone(),
            model_error,
            alternatives: alternatives(&others, knobs),
            data_parallel,
            state_note: knobs.state.difference(),
            precision_note: knobs.precision.note().map(str::to_string),
            // The caller knows how the trials ran.
            provenance: None,
            model_folder: None,
            non_monotone: crate::fit::non_monotone(&outcome.history, &budget),
            ruled_out: driver.accumulation_ruled_out(&outcome.history),
            longest_sequence: None,
            data: None,
        })
    }
}

impl Plan {
    /// Completes a data-parallel plan's scaling efficiency when the search never ran the chosen
    /// per-GPU setting on one GPU (a single-GPU regime pruned early, say): `prober` runs that
    /// trial, as long as a search trial, and its throughput is recorded. Nothing to do for a
    /// single-GPU plan or one whose search measured it; a trial that does not fit leaves the
    /// efficiency `null`.
    pub fn measure_scaling(
        &mut self,
        space: &crate::search::space::SearchSpace,
        prober: &mut dyn crate::trial::Prober,
    ) -> crate::Result<()> {
        let Some(report) = &mut self.data_parallel else {
            return Ok(());
        };
        if report.single_gpu_tokens_per_s.is_some() {
            return Ok(());
        }
        let single = Knobs {
            data_parallel: DataParallel::SINGLE,
            ..self.knobs
        };
        let result = prober.probe(&space.search_request(single.regime(), single.micro_batch))?;
        let parallel = Knobs {
            grad_accum: 1,
            ..self.knobs
        };
        let history: Vec<TrialResult> = self
            .evidence
            .iter()
            .filter(|r| r.request.knobs == parallel)
            .cloned()
            .chain(std::iter::once(result))
            .collect();
        *report = scaling_report(self.knobs, &history);
        Ok(())
    }
}

/// The layout of data-parallel `knobs` and its measured scaling: the search trial of the same
/// per-GPU setting (without accumulation) at the chosen degree against one on a single GPU.
fn scaling_report(knobs: Knobs, history: &[TrialResult]) -> DataParallelReport {
    let trial_tokens_per_s = |data_parallel: DataParallel| {
        let wanted = Knobs {
            grad_accum: 1,
            data_parallel,
            ..knobs
        };
        history
            .iter()
            .filter(|r| r.request.knobs == wanted)
            .find_map(|r| r.outcome.measurement().map(|m| m.tokens_per_s))
    };
    let single = trial_tokens_per_s(DataParallel::SINGLE);
    let parallel = trial_tokens_per_s(knobs.data_parallel);
    let degree = knobs.data_parallel.degree;
    DataParallelReport {
        degree,
        shard_optimizer: knobs.data_parallel.shard_optimizer,
        global_batch: knobs.global_batch(),
        single_gpu_tokens_per_s: single,
        scaling_efficiency: single
            .zip(parallel)
            .filter(|(s, _)| *s > 0.0)
            .map(|(s, p)| p / (degree as f64 * s)),
    }
}

/// A measurement's 95 % tokens/s interval as a plan records it.
fn interval(m: &Measurement) -> [f64; 2] {
    let (low, high) = m.tokens_per_s_interval();
    [low, high]
}

/// The best setting of each other regime, then the next best overall, up to
/// [`MAX_ALTERNATIVES`], best first. Regimes come first so that a reader sees what each
/// trade-off (checkpointing, offload) would cost, not five neighbours of the chosen batch; the
/// largest feasible batch of the chosen regime comes with them where it is larger than the
/// plan's, since "why not a larger batch?" is the first question a plan below its memory limit
/// raises (it measured slower: see [`Plan::larger_batch_measured_slower`]).
fn alternatives(ranked: &[Candidate], chosen: Knobs) -> Vec<Alternative> {
    let mut picked: Vec<&Candidate> = Vec::new();
    for c in ranked {
        let regime = c.knobs.regime();
        if regime != chosen.regime() && !picked.iter().any(|p| p.knobs.regime() == regime) {
            picked.push(c);
        }
    }
    let larger = ranked
        .iter()
        .filter(|c| c.knobs.regime() == chosen.regime())
        .filter(|c| c.knobs.micro_batch > chosen.micro_batch)
        .max_by_key(|c| c.knobs.micro_batch);
    picked.truncate(MAX_ALTERNATIVES - usize::from(larger.is_some()));
    picked.extend(larger);
    for c in ranked {
        if picked.len() >= MAX_ALTERNATIVES {
            break;
        }
        if !picked.iter().any(|p| p.knobs == c.knobs) {
            picked.push(c);
        }
    }
    picked.sort_by(|a, b| {
        b.measurement
            .tokens_per_s
            .total_cmp(&a.measurement.tokens_per_s)
    });
    picked
        .into_iter()
        .map(|c| Alternative {
            knobs: c.knobs,
            tokens_per_s: c.measurement.tokens_per_s,
            tokens_per_s_interval: Some(interval(&c.measurement)),
            peak_gpu_bytes: c.measurement.peak_gpu_bytes,
            peak_host_bytes: c.measurement.peak_host_bytes,
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::knobs::{Checkpointing, Offload, Precision, Regime};
    use crate::search::report::NoReporter;
    use crate::search::run::run_search;
    use crate::search::sim::{Law, SimRegime, Simulator};
    use crate::search::space::SearchSpace;
    use crate::search::MachineFacts;
    use crate::spec::budget::Budget;

    const MIB: f64 = (1u64 << 20) as f64;

    /// A search on the 4090 profile over bf16 and bf16 + full recompute, with simulated laws,
    /// and the plan it yields.
    pub(crate) fn sample() -> (SearchDriver, SearchOutcome, Plan) {
        let device = DeviceSpec::builtin("rtx4090-32g").unwrap();
        let model = ModelSpec::preset("gpt-124m").unwrap();
        let budget = Budget::from_device(&device);
        let bf16 = Regime {
            precision: Precision::Bf16,
            checkpointing: Checkpointing::None,
            offload: Offload::None,
            data_parallel: crate::knobs::DataParallel::SINGLE,
            update: Default::default(),
            state: Default::default(),
        };
        let ckpt = Regime {
            checkpointing: Checkpointing::EveryKth(1),
            ..bf16
        };
        let law = |regime, per_sample_mib: f64, per_sample_s: f64| SimRegime {
            regime,
            gpu_bytes: Law::affine(3000.0 * MIB, per_sample_mib * MIB),
            host_bytes: Law::affine(4000.0 * MIB, 0.0),
            step_time_s: Law::affine(0.02, per_sample_s),
        };
        let sim = Simulator::with_budget(
            &budget,
            model.seq_len,
            vec![law(bf16, 1300.0, 0.0045), law(ckpt, 250.0, 0.006)],
        );
        let space = SearchSpace {
            global_batch: Some(64),
            ..SearchSpace::new(vec![bf16, ckpt])
        };
        let driver = SearchDriver::new(space, MachineFacts::default(), budget).unwrap();
        let outcome = run_search(
            &driver,
            &mut |r: &crate::trial::TrialRequest| Ok(sim.answer(r)),
            &NoReporter,
        )
        .unwrap();
        let plan = Plan::from_search(&driver, &outcome, &model, &device, 1_767_225_600).unwrap();
        (driver, outcome, plan)
    }

    #[test]
    fn plan_records_the_verified_choice_and_its_evidence() {
        let (driver, outcome, plan) = sample();
        // bf16: (0.95 · 24564 − 3000) / 1300 = 15.6 → 8 (divisors of 64); ckpt: 81.8 → 64.
        assert_eq!((plan.knobs.micro_batch, plan.knobs.grad_accum), (64, 1));
        assert_eq!(plan.knobs.checkpointing, Checkpointing::EveryKth(1));
        assert_eq!(plan.evidence, outcome.history);
        assert_eq!(
            plan.measured,
            *outcome
                .history
                .last()
                .unwrap()
                .outcome
                .measurement()
                .unwrap()
        );
        let predicted_gpu = plan.predicted.peak_gpu_bytes.unwrap() as f64;
        assert!((predicted_gpu - plan.measured.peak_gpu_bytes as f64).abs() < 1.0);
        let predicted_tokens = plan.predicted.tokens_per_s.unwrap();
        assert!((predicted_tokens / plan.measured.tokens_per_s - 1.0).abs() < 1e-6);
        assert!(plan.model_error.memory_loo_rel_error.unwrap() < 1e-9);
        assert_eq!(
            plan.headroom.gpu_bytes,
            Some(plan.budget.gpu_bytes.unwrap() - plan.measured.peak_gpu_bytes)
        );
        // Alternatives: bf16's best is among them, none is the chosen knobs, best first.
        assert!(plan
            .alternatives
            .iter()
            .any(|a| a.knobs.checkpointing == Checkpointing::None));
        assert!(plan.alternatives.iter().all(|a| a.knobs != plan.knobs));
        assert!(plan
            .alternatives
            .windows(2)
            .all(|w| w[0].tokens_per_s >= w[1].tokens_per_s));
        assert!(plan.alternatives.len() <= MAX_ALTERNATIVES);
        assert!(plan
            .alternatives
            .iter()
            .all(|a| a.knobs.global_batch() == 64));
        assert!(driver.candidates(&plan.evidence).len() > plan.alternatives.len());
    }

    /// A fitting candidate of `regime` at `micro_batch` that measured `tokens_per_s`.
    fn candidate(regime: Regime, micro_batch: usize, tokens_per_s: f64) -> Candidate {
        Candidate {
            knobs: Knobs::with_batch(regime, micro_batch, 1),
            measurement: Measurement {
                peak_gpu_bytes: 1 << 30,
                peak_host_bytes: 1 << 30,
                step_time_median_s: 1024.0 * micro_batch as f64 / tokens_per_s,
                step_time_spread: 0.01,
                timed_steps: 3,
                tokens_per_s,
                host_link: None,
            },
            history_index: 0,
        }
    }

    #[test]
    fn a_larger_batch_of_the_plans_own_setting_is_among_the_alternatives_and_named() {
        let (_, _, mut plan) = sample();
        let chosen = plan.knobs;
        let regime = chosen.regime();
        // Five other regimes, each faster than the chosen regime's larger batch, and two larger
        // batches of the chosen regime: the largest comes with the other regimes' best.
        let others: Vec<Regime> = (2..7)
            .map(|k| Regime {
                checkpointing: Checkpointing::EveryKth(k),
                ..regime
            })
            .collect();
        let mut ranked: Vec<Candidate> =
            others.iter().map(|&r| candidate(r, 8, 90_000.0)).collect();
        ranked.push(candidate(regime, chosen.micro_batch + 2, 80_000.0));
        ranked.push(candidate(regime, chosen.micro_batch + 4, 70_000.0));
        let picked = alternatives(&ranked, chosen);
        assert_eq!(picked.len(), MAX_ALTERNATIVES);
        let larger: Vec<usize> = picked
            .iter()
            .filter(|a| a.knobs.regime() == regime)
            .map(|a| a.knobs.micro_batch)
            .collect();
        assert_eq!(larger, [chosen.micro_batch + 4]);

        plan.alternatives = picked;
        plan.measured.tokens_per_s = 100_000.0;
        let named = plan.larger_batch_measured_slower().unwrap();
        assert_eq!(named.knobs.micro_batch, chosen.micro_batch + 4);
        // One that measured faster than the plan is no reason the plan is smaller.
        plan.measured.tokens_per_s = 60_000.0;
        assert!(plan.larger_batch_measured_slower().is_none());
        plan.measured.tokens_per_s = 100_000.0;
        plan.alternatives.retain(|a| a.knobs.regime() != regime);
        assert!(plan.larger_batch_measured_slower().is_none());
    }

    #[test]
    fn no_plan_without_a_choice() {
        let (driver, mut outcome, _) = sample();
        let device = DeviceSpec::builtin("rtx4090-32g").unwrap();
        let model = ModelSpec::preset("gpt-124m").unwrap();
        outcome.decision = crate::search::decision::Decision::NoFeasible {
            hint: "none".into(),
        };
        assert_eq!(
            Plan::from_search(&driver, &outcome, &model, &device, 0),
            None
        );
    }

    #[test]
    fn a_data_parallel_plan_measures_its_missing_single_gpu_trial() {
        use crate::knobs::DataParallel;
        use crate::trial::{Outcome, TrialRequest};
        let (driver, _, mut plan) = sample();
        plan.knobs.data_parallel = DataParallel::replicated(2);
        let parallel = Knobs {
            grad_accum: 1,
            ..plan.knobs
        };
        // As if the search had pruned the single-GPU regime before that micro-batch.
        let single = Knobs {
            data_parallel: DataParallel::SINGLE,
            ..parallel
        };
        let mut trial = plan.evidence[0].clone();
        plan.evidence.retain(|r| r.request.knobs != single);
        trial.request.knobs = parallel;
        let Outcome::Fits(m) = &mut trial.outcome else {
            panic!("the sample's first trial fits");
        };
        m.tokens_per_s = 1800.0;
        plan.evidence.push(trial.clone());
        plan.data_parallel = Some(scaling_report(plan.knobs, &plan.evidence));
        assert_eq!(plan.data_parallel.unwrap().scaling_efficiency, None);

        let mut asked: Vec<TrialRequest> = Vec::new();
        plan.measure_scaling(driver.space(), &mut |r: &crate::trial::TrialRequest| {
            asked.push(*r);
            let mut single = trial.clone();
            single.request = *r;
            if let Outcome::Fits(m) = &mut single.outcome {
                m.tokens_per_s = 1000.0;
            }
            Ok(single)
        })
        .unwrap();
        assert_eq!(asked.len(), 1);
        assert_eq!(asked[0].knobs.data_parallel, DataParallel::SINGLE);
        assert_eq!(asked[0].knobs.grad_accum, 1);
        let report = plan.data_parallel.unwrap();
        assert_eq!(report.single_gpu_tokens_per_s, Some(1000.0));
        assert!((report.scaling_efficiency.unwrap() - 0.9).abs() < 1e-12);
        // Measured once: a second call runs nothing.
        plan.measure_scaling(driver.space(), &mut |_: &crate::trial::TrialRequest| {
            panic!("no second trial")
        })
        .unwrap();
    }
}
