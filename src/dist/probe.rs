//! Trials of data-parallel settings: N `autotune probe-one` ranks run the trial together, and
//! their results are combined into one, so what the search sees is measured on N GPUs.
//!
//! - **GPU memory** is the largest peak of any rank: each GPU must fit its own.
//! - **Host memory** is the sum of the ranks' peaks: they share one host. Each rank gets an
//!   even share of the host budget as its own limit.
//! - **Step time** is the slowest rank's median (the ranks wait for each other every step, so
//!   they differ only by timing noise), and tokens/s counts the tokens of all ranks.
//! - If any rank ran out of memory the setting does not fit, even though the other ranks then
//!   fail on the broken group rather than report an outcome themselves.

use std::time::{Duration, Instant};

use crate::dist::launch::{self, Launch, RankExit, RankInput};
use crate::probe::job::TrialProcesses;
use crate::spec::device::DeviceKind;
use crate::trial::{Measurement, MemoryKind, Outcome, Phase, Prober, TrialRequest, TrialResult};
use crate::{Error, Result};

/// The most data-parallel ranks on the CPU: processes of one host.
pub const MAX_CPU_RANKS: usize = 64;

/// How long the other ranks of a trial may run on after one has finished (one that stopped at
/// an out-of-memory leaves the others blocked in a collective).
const GRACE_AFTER_EXIT: Duration = Duration::from_secs(20);

/// Runs each trial as `knobs.data_parallel.degree` child processes.
pub struct DataParallelProber {
    trials: TrialProcesses,
}

impl DataParallelProber {
    /// A prober re-executing `trials.program` (normally the running `autotune`) as ranks on
    /// the setup's device (`cpu` or `cuda`: rank r then pins `cuda:r`); the setup's host
    /// budget is the whole host's.
    pub fn new(trials: TrialProcesses) -> Self {
        Self { trials }
    }
}

impl Prober for DataParallelProber {
    /// Runs one trial on all ranks; a rank's crash or out-of-memory is an outcome.
    fn probe(&mut self, request: &TrialRequest) -> autotune_core::Result<TrialResult> {
        let started = Instant::now();
        let ranks = request.knobs.data_parallel.degree;
        let mut job = self.trials.job(request);
        job.setup.host_budget = job.setup.host_budget.map(|b| b / ranks.max(1) as u64);
        let on_gpu = job.setup.device_kind() == DeviceKind::Cuda;
        let launch = Launch {
            program: self.trials.program.clone(),
            args: vec!["probe-one".into()],
            world_size: ranks,
            rendezvous: launch::rendezvous_for(on_gpu)?,
            input: RankInput::Job(serde_json::to_vec(&job).expect("jobs always serialise")),
            grace_after_exit: Some(GRACE_AFTER_EXIT),
            deadline: Some(self.trials.timeout.limit(request)),
        };
        let mut results: Vec<Option<TrialResult>> = vec![None; ranks];
        let never = std::sync::atomic::AtomicBool::new(false);
        let outcome = launch::run(&launch, &never, &mut |event| {
            if let launch::LaunchEvent::Output { rank, line } = event {
                if let Ok(result) = serde_json::from_str::<TrialResult>(&line) {
                    results[rank] = Some(result);
                }
            }
        })?;
        let combined = if outcome.timed_out {
            Outcome::TimedOut {
                after_s: self.trials.timeout.limit(request).as_secs_f64(),
            }
        } else {
            combine(request, &results, &outcome.exits, outcome.failure.as_ref())
        };
        let result = TrialResult {
            request: *request,
            outcome: combined,
            wall_s: started.elapsed().as_secs_f64(),
        };
        self.trials.timeout.observe(&result);
        Ok(result)
    }
}

/// Sends each trial by its data-parallel degree: one-GPU trials to `single`, the others to
/// their ranks. How a search over several degrees runs, whatever isolates its one-GPU trials.
pub struct ByDegree {
    single: Box<dyn Prober>,
    ranks: DataParallelProber,
}

impl ByDegree {
    /// Routes one-GPU trials to `single` and data-parallel ones to `ranks`.
    pub fn new(single: Box<dyn Prober>, ranks: DataParallelProber) -> Self {
        Self { single, ranks }
    }
}

impl Prober for ByDegree {
    fn probe(&mut self, request: &TrialRequest) -> autotune_core::Result<TrialResult> {
        match request.knobs.data_parallel.degree {
            1 => self.single.probe(request),
            _ => self.ranks.probe(request),
        }
    }
}

/// One outcome from every rank's result (`None` where a rank printed none).
fn combine(
    request: &TrialRequest,
    results: &[Option<TrialResult>],
    exits: &[RankExit],
    failure: Option<&launch::RankFailure>,
) -> Outcome {
    let outcomes: Vec<Option<&Outcome>> = results
        .iter()
        .map(|r| r.as_ref().map(|r| &r.outcome))
        .collect();
    if let Some(oom) = outcomes
        .iter()
        .flatten()
        .find(|o| matches!(o, Outcome::OutOfMemory { .. }))
    {
        return (*oom).clone();
    }
    // The out-of-memory killer's signal is host memory running out, as for a single child.
    if exits.contains(&RankExit::Signal(9)) {
        return Outcome::OutOfMemory {
            memory: MemoryKind::Host,
            phase: Phase::ForwardBackward,
        };
    }
    let measurements: Option<Vec<&Measurement>> = outcomes
        .iter()
        .map(|o| o.and_then(Outcome::measurement))
        .collect();
    match measurements {
        Some(all) if !all.is_empty() => Outcome::Fits(merge(request, &all)),
        _ => {
            if let Some(crash) = outcomes
                .iter()
                .flatten()
                .find(|o| matches!(o, Outcome::Crashed { .. }))
            {
                return (*crash).clone();
            }
            let reason = match failure {
                Some(f) => format!("data-parallel trial: {f}"),
                None => "data-parallel trial: a rank reported no result".into(),
            };
            Outcome::Crashed { reason }
        }
    }
}

fn merge(request: &TrialRequest, ranks: &[&Measurement]) -> Measurement {
    let slowest = ranks
        .iter()
        .map(|m| m.step_time_median_s)
        .fold(0.0, f64::max);
    let root = ranks[0];
    let tokens = root.tokens_per_s * root.step_time_median_s;
    Measurement {
        peak_gpu_bytes: ranks.iter().map(|m| m.peak_gpu_bytes).max().unwrap_or(0),
        peak_host_bytes: ranks.iter().map(|m| m.peak_host_bytes).sum(),
        step_time_median_s: slowest,
        step_time_spread: ranks.iter().map(|m| m.step_time_spread).fold(0.0, f64::max),
        timed_steps: request.timed_steps.min(root.timed_steps),
        tokens_per_s: if slowest > 0.0 { tokens / slowest } else { 0.0 },
        host_link: root.host_link,
    }
}

/// Checks that a data-parallel trial can run here: `degree` ranks need that many GPUs.
pub fn check_degree(degree: usize, device: &str, flag: &str) -> Result<()> {
    if degree <= 1 {
        return Ok(());
    }
    if !device.starts_with("cuda") {
        // CPU ranks are processes of this host, each with a whole copy of the model.
        if degree > MAX_CPU_RANKS {
            return Err(Error::invalid(
                "data parallelism",
                flag,
                format!(
                    "asks for {degree} CPU ranks; at most {MAX_CPU_RANKS} run on one host (they share its cores and memory)"
                ),
            ));
        }
        return Ok(());
    }
    let visible = crate::backend::cuda_device_count();
    if degree > visible {
        return Err(Error::invalid(
            "data parallelism",
            flag,
            format!(
                "asks for {degree} GPUs but {visible} are visible (CUDA_VISIBLE_DEVICES applies); use at most {visible}, or run on a host with {degree}"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Knobs;

    fn request() -> TrialRequest {
        TrialRequest {
            knobs: Knobs::new(2, crate::Precision::Fp32),
            warmup_steps: 1,
            timed_steps: 3,
            remeasure: false,
        }
    }

    fn fits(gpu: u64, host: u64, step: f64, tokens_per_s: f64) -> Option<TrialResult> {
        Some(TrialResult {
            request: request(),
            outcome: Outcome::Fits(Measurement {
                peak_gpu_bytes: gpu,
                peak_host_bytes: host,
                step_time_median_s: step,
                step_time_spread: 0.1,
                timed_steps: 3,
                tokens_per_s,
                host_link: None,
            }),
            wall_s: 1.0,
        })
    }

    #[test]
    fn gpu_peaks_take_the_largest_rank_host_peaks_add_up_and_time_is_the_slowest() {
        let ok = [RankExit::Code(0), RankExit::Code(0)];
        let results = [fits(100, 10, 0.5, 4000.0), fits(120, 12, 0.8, 2500.0)];
        let Outcome::Fits(m) = combine(&request(), &results, &ok, None) else {
            panic!("expected a fit");
        };
        assert_eq!((m.peak_gpu_bytes, m.peak_host_bytes), (120, 22));
        assert_eq!(m.step_time_median_s, 0.8);
        // Rank 0 saw 2000 tokens per step; at the slowest rank's pace that is 2500 tokens/s.
        assert!((m.tokens_per_s - 2500.0).abs() < 1e-9, "{}", m.tokens_per_s);
    }

    #[test]
    fn one_rank_out_of_memory_makes_the_setting_not_fit() {
        let oom = Some(TrialResult {
            outcome: Outcome::OutOfMemory {
                memory: MemoryKind::Gpu,
                phase: Phase::ForwardBackward,
            },
            ..fits(0, 0, 0.0, 0.0).unwrap()
        });
        // Rank 0 failed on the broken group and printed nothing; rank 1 ran out of memory.
        let exits = [RankExit::Code(2), RankExit::Code(0)];
        assert!(matches!(
            combine(&request(), &[None, oom], &exits, None),
            Outcome::OutOfMemory {
                memory: MemoryKind::Gpu,
                ..
            }
        ));
        let killed = [RankExit::Signal(9), RankExit::Stopped];
        assert!(matches!(
            combine(&request(), &[None, None], &killed, None),
            Outcome::OutOfMemory {
                memory: MemoryKind::Host,
                ..
            }
        ));
        let crashed = combine(&request(), &[None, None], &[RankExit::Code(2); 2], None);
        assert!(matches!(crashed, Outcome::Crashed { .. }));
    }
}
