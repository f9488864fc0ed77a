//! The explanation given when no setting is feasible: what ran out, and what to try instead.

use super::driver::{SearchDriver, SortedHistory};
use crate::knobs::Checkpointing;
use crate::knobs::Offload;
use crate::trial::{MemoryKind, Outcome};

/// The facts first (per regime, why its smallest probed micro-batch is infeasible), then the
/// knobs not yet tried that relieve the memory that ran out.
pub(super) fn no_feasible_hint(
    driver: &SearchDriver,
    sorted: &SortedHistory<'_>,
    limit_reached: bool,
) -> String {
    let space = driver.space();
    let budget = driver.budget();
    let (mut gpu_short, mut host_short, mut crashed) = (false, false, false);
    let mut over_headroom: Option<MemoryKind> = None;
    let mut facts: Vec<String> = Vec::new();
    for (regime, trials) in space.regimes.iter().zip(&sorted.search) {
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
                gpu_short = true;
                "runs out of GPU memory".to_string()
            }
            Outcome::OutOfMemory {
                memory: MemoryKind::Host,
                ..
            } => {
                host_short = true;
                format!(
                    "runs out of host memory (budget {})",
                    human_bytes(budget.host_bytes)
                )
            }
            Outcome::Crashed { reason } => {
                crashed = true;
                format!("crashed ({reason})")
            }
            Outcome::Fits(m) => match budget.exceeded(m) {
                Some(kind) => {
                    over_headroom = over_headroom.or(Some(kind));
                    format!(
                        "fits only inside the {:.0}% headroom of {} memory",
                        budget.headroom * 100.0,
                        kind_name(kind)
                    )
                }
                None => "fitted but failed its verification run".to_string(),
            },
        };
        facts.push(format!(
            "{regime}: micro_batch={} {why}",
            smallest.request.knobs.micro_batch
        ));
    }

    let mut tips: Vec<&str> = Vec::new();
    if gpu_short || over_headroom == Some(MemoryKind::Gpu) {
        if !space
            .regimes
            .iter()
            .any(|r| r.checkpointing != Checkpointing::None)
        {
            tips.push("activation checkpointing (`all`)");
        }
        if !space
            .regimes
            .iter()
            .any(|r| r.offload == Offload::Optimizer)
            && budget.gpu_bytes.is_some()
        {
            tips.push("optimizer offload");
        }
        tips.push("a shorter seq_len or a smaller model");
    }
    if host_short || over_headroom == Some(MemoryKind::Host) {
        if space
            .regimes
            .iter()
            .any(|r| r.offload == Offload::Optimizer)
        {
            tips.push(
                "no optimizer offload (it keeps about 12 bytes per parameter in host memory)",
            );
        }
        tips.push("a larger host budget");
    }
    if over_headroom.is_some() {
        tips.push("a smaller headroom");
    }
    if limit_reached {
        tips.push("a higher probe limit");
    }
    if crashed {
        tips.push("running one setting with `autotune probe` to see the error");
    }
    let mut hint = format!("no setting is feasible: {}", facts.join("; "));
    if !tips.is_empty() {
        hint.push_str(&format!("; try {}", tips.join(", or ")));
    }
    hint
}

fn kind_name(kind: MemoryKind) -> &'static str {
    match kind {
        MemoryKind::Gpu => "GPU",
        MemoryKind::Host => "host",
    }
}

/// Bytes in the largest binary unit that keeps a number at least 1, one decimal.
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
