//! How the commands read for people: the progress each draws on stderr while trials or steps
//! run, the text of their results, and the one way outcomes and budgets are written (bytes by
//! the core's formatter). One file per command that has more to say than a line.

pub mod check;
pub mod estimate;
pub mod search;
pub mod train;

use autotune::spec::budget::Budget;
use autotune::trial::{MemoryKind, Outcome, TrialResult};

/// Bytes for people: the core's one formatter.
pub use autotune::spec::budget::format_bytes as bytes;

/// "GPU" or "host".
pub fn memory_name(memory: MemoryKind) -> &'static str {
    match memory {
        MemoryKind::Gpu => "GPU",
        MemoryKind::Host => "host",
    }
}

/// A budget as one phrase: "GPU 24.00 GiB, host 32.00 GiB, headroom 5%".
pub fn budget(budget: &Budget) -> String {
    let host = format!("host {}", bytes(budget.host_bytes));
    match budget.gpu_bytes {
        Some(g) => format!(
            "GPU {}, {host}, headroom {:.0}%",
            bytes(g),
            budget.headroom * 100.0
        ),
        None => format!("{host}, headroom {:.0}%", budget.headroom * 100.0),
    }
}

/// What a finished search trial found, as its progress line says it.
pub fn trial_outcome(result: &TrialResult, feasible: bool) -> String {
    match &result.outcome {
        Outcome::Fits(m) => format!(
            "{} {:.0} tokens/s{}, peak GPU {}, host {}",
            if feasible {
                "fits,"
            } else {
                "fits but above the headroom,"
            },
            m.tokens_per_s,
            m.interval_text(),
            bytes(m.peak_gpu_bytes),
            bytes(m.peak_host_bytes)
        ),
        other => failure(other),
    }
}

/// What a trial that did not fit ran into.
pub fn failure(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Fits(_) => "fits".to_string(),
        Outcome::OutOfMemory { memory, phase } => {
            format!("out of {} memory during {phase:?}", memory_name(*memory))
        }
        Outcome::Crashed { reason } => format!("crashed: {reason}"),
        Outcome::TimedOut { after_s } => format!("timed out after {after_s:.0} s"),
    }
}
