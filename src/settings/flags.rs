//! Errors about flags named as the user typed them: the core validates knobs, spaces and
//! budgets by their JSON field names (`micro_batch`), which this maps back to the flag that set
//! them (`--micro-batch`) for each command; and the notes that renamed flags leave.

use autotune_core::Error;

/// A command's flags by the field each sets.
pub type FlagNames = &'static [(&'static str, &'static str)];

/// The knob flags `train` and `probe` share.
const KNOB_FLAGS: [(&str, &str); 5] = [
    ("micro_batch", "--micro-batch"),
    ("grad_accum", "--grad-accum"),
    ("checkpointing", "--checkpointing"),
    ("data_parallel.degree", "--data-parallel"),
    ("data_parallel.shard_optimizer", "--shard-optimizer"),
];

/// `train`'s flags.
pub const TRAIN: FlagNames = &KNOB_FLAGS;

/// `probe`'s flags: the knobs, and the trial's lengths.
pub const PROBE: FlagNames = &[
    KNOB_FLAGS[0],
    KNOB_FLAGS[1],
    KNOB_FLAGS[2],
    KNOB_FLAGS[3],
    KNOB_FLAGS[4],
    ("warmup_steps", "--warmup"),
    ("timed_steps", "--steps"),
];

/// `tune`'s flags: the search space and the budget.
pub const TUNE: FlagNames = &[
    ("max_micro_batch", "--max-micro-batch"),
    ("start_micro_batch", "--max-micro-batch"),
    ("global_batch", "--global-batch"),
    ("warmup_steps", "--trial-warmup-steps"),
    ("timed_steps", "--timed-steps"),
    ("max_probes", "--max-trials"),
    ("saturation_gain", "--saturation-gain"),
    ("headroom", "--headroom"),
    ("checkpointing", "--checkpointing"),
];

/// `error` with its field named as the flag that set it, when `flags` has one; the core names
/// some fields as flags itself (`--data-parallel`), and those are kept.
pub fn as_flag(error: impl Into<Error>, flags: FlagNames) -> Error {
    match error.into() {
        Error::InvalidSpec { field, problem, .. } if field.starts_with("--") => {
            Error::InvalidFlag {
                flag: field,
                problem,
            }
        }
        Error::InvalidSpec {
            what,
            field,
            problem,
        } => {
            // A regime's field (`regimes[2].checkpointing`) came from the flag of its last part;
            // a trial's knobs are `knobs.micro_batch`.
            let key = field.strip_prefix("knobs.").unwrap_or(&field);
            let last = field.rsplit('.').next().unwrap_or(&field);
            let flag = flags
                .iter()
                .find(|(f, _)| *f == key || (field.starts_with("regimes[") && *f == last))
                .map(|(_, flag)| flag.to_string());
            match flag {
                Some(flag) => Error::InvalidFlag { flag, problem },
                None => Error::InvalidSpec {
                    what,
                    field,
                    problem,
                },
            }
        }
        other => other,
    }
}

/// The note an old flag name leaves when it is used: the flag it became, and that the old
/// name keeps working (so scripts do not break).
pub fn renamed(old: &str, new: &str) -> String {
    format!("`{old}` is now `{new}`; the old name still works, but may mean something else in other commands")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flag(e: Error) -> String {
        match e {
            Error::InvalidFlag { flag, .. } => flag,
            other => panic!("expected a flag error, got {other:?}"),
        }
    }

    #[test]
    fn fields_become_the_flags_that_set_them() {
        let knobs = crate::Knobs::new(0, crate::Precision::Fp32);
        let e = knobs.validate("knobs", "").unwrap_err();
        assert_eq!(flag(as_flag(e, TRAIN)), "--micro-batch");
        let e = Error::invalid("search space", "max_probes", "must be at least 1");
        assert_eq!(flag(as_flag(e, TUNE)), "--max-trials");
        let e = Error::invalid("search space", "--data-parallel", "too many");
        assert_eq!(flag(as_flag(e, TUNE)), "--data-parallel");
        let e = Error::invalid("knobs", "timed_steps", "too many");
        assert_eq!(flag(as_flag(e, PROBE)), "--steps");
        let e = Error::invalid("search space", "regimes[1].checkpointing", "k");
        assert_eq!(flag(as_flag(e, TUNE)), "--checkpointing");
        let e = Error::invalid("model spec", "d_model", "too large");
        assert!(matches!(as_flag(e, TUNE), Error::InvalidSpec { .. }));
    }
}
