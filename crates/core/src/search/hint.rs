//! The explanation given when no setting is feasible: what ran out, and what to try instead.

use super::decision::AccumulationRuledOut;
use super::driver::{SearchDriver, SortedHistory};
use crate::knobs::Checkpointing;
use crate::knobs::Offload;
use crate::spec::budget::format_bytes;
use crate::trial::{MemoryKind, Outcome};

/// The facts first (per regime, why its smallest tried micro-batch is infeasible), then the
/// knobs not yet tried that relieve the memory that ran out.
pub(super) fn no_feasible_hint(
    driver: &SearchDriver,
    sorted: &SortedHistory<'_>,
    limit_reached: bool,
) -> String {
    let (facts, shortage) = facts(driver, sorted);
    let tips = tips(driver, &shortage, limit_reached);
    let mut hint = format!("no setting is feasible: {}", facts.join("; "));
    if !tips.is_empty() {
        hint.push_str(&format!("; try {}", tips.join(", or ")));
    }
    hint
}

/// What the regimes' smallest trials ran short of.
#[derive(Default)]
struct Shortage {
    gpu: bool,
    host: bool,
    crashed: bool,
    /// The first memory that fitted only inside the headroom.
    over_headroom: Option<MemoryKind>,
    /// A trial fitted, but its plan's accumulation would not.
    accumulation: bool,
}

/// One line per regime: why its smallest tried micro-batch is infeasible.
fn facts(driver: &SearchDriver, sorted: &SortedHistory<'_>) -> (Vec<String>, Shortage) {
    let budget = driver.budget();
    let ruled_out = driver.ruled_out(sorted);
    let mut shortage = Shortage::default();
    let mut facts = Vec::new();
    for (regime, trials) in driver.space().regimes.iter().zip(&sorted.search) {
        let Some((_, smallest)) = trials
            .iter()
            .min_by_key(|(_, r)| r.request.knobs.micro_batch)
        else {
            facts.push(format!("{regime}: not tried"));
            continue;
        };
        let why = match &smallest.outcome {
            Outcome::OutOfMemory {
                memory: MemoryKind::Gpu,
                ..
            } => {
                shortage.gpu = true;
                "runs out of GPU memory".to_string()
            }
            Outcome::OutOfMemory {
                memory: MemoryKind::Host,
                ..
            } => {
                shortage.host = true;
                format!(
                    "runs out of host memory (budget {})",
                    format_bytes(budget.host_bytes)
                )
            }
            Outcome::Crashed { reason } => {
                shortage.crashed = true;
                format!("crashed ({reason})")
            }
            Outcome::TimedOut { after_s } => {
                shortage.crashed = true;
                format!("did not finish within its {after_s:.0} s time limit")
            }
            Outcome::Fits(m) => match budget.exceeded(m) {
                Some(kind) => {
                    shortage.over_headroom = shortage.over_headroom.or(Some(kind));
                    format!(
                        "fits only inside the {:.0}% headroom of {} memory",
                        budget.headroom * 100.0,
                        kind_name(kind)
                    )
                }
                None => match ruled_out
                    .iter()
                    .find(|r| r.is_plan_of(&smallest.request.knobs))
                {
                    Some(r) => {
                        shortage.accumulation = true;
                        accumulation_fact(r)
                    }
                    None => "fitted but failed its verification run".to_string(),
                },
            },
        };
        facts.push(format!(
            "{regime}: micro_batch={} {why}",
            smallest.request.knobs.micro_batch
        ));
    }
    (facts, shortage)
}

/// Why a trial that fitted has no plan: what accumulating its micro-batches would add.
fn accumulation_fact(ruled_out: &AccumulationRuledOut) -> String {
    format!(
        "fits alone, but accumulating {} of them adds about {} of summed gradients",
        ruled_out.knobs.grad_accum,
        format_bytes(ruled_out.added_bytes as u64)
    )
}

/// The settings not yet searched that relieve what ran short.
fn tips(driver: &SearchDriver, shortage: &Shortage, limit_reached: bool) -> Vec<&'static str> {
    let space = driver.space();
    let any_checkpointing = space
        .regimes
        .iter()
        .any(|r| r.checkpointing != Checkpointing::None);
    let any_offload = space
        .regimes
        .iter()
        .any(|r| r.offload == Offload::Optimizer);
    let mut tips = Vec::new();
    if shortage.gpu || shortage.over_headroom == Some(MemoryKind::Gpu) {
        if !any_checkpointing {
            tips.push("activation checkpointing (`all`)");
        }
        if !any_offload && driver.budget().gpu_bytes.is_some() {
            tips.push("optimizer offload");
        }
        tips.push("a shorter seq_len or a smaller model");
    }
    if shortage.accumulation {
        tips.push("a smaller `--global-batch` (fewer micro-batches accumulated)");
        if !any_offload && driver.budget().gpu_bytes.is_some() {
            tips.push("optimizer offload (it sums gradients in host memory)");
        }
    }
    if shortage.host || shortage.over_headroom == Some(MemoryKind::Host) {
        if any_offload {
            tips.push(
                "no optimizer offload (it keeps about 12 bytes per parameter in host memory)",
            );
        }
        tips.push("a larger host budget");
    }
    if shortage.over_headroom.is_some() {
        tips.push("a smaller headroom");
    }
    if limit_reached {
        tips.push("a higher trial limit (`--max-trials`)");
    }
    if shortage.crashed {
        tips.push("running one setting with `autotune probe` to see the error");
    }
    tips
}

fn kind_name(kind: MemoryKind) -> &'static str {
    match kind {
        MemoryKind::Gpu => "GPU",
        MemoryKind::Host => "host",
    }
}
