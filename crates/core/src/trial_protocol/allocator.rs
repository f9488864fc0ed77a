//! The allocator setting a trial runner's trials run under, which autotune gives the runner in
//! its environment and a plan carries to its exports.
//!
//! PyTorch's default caching allocator splits the blocks it caches, so its peak need not grow
//! with the batch: a larger micro-batch can fit where a smaller one ran out of memory. With
//! expandable segments, blocks grow in place and the peak follows what the step holds, so a
//! search's boundary is one that training under the same setting meets. A batch measured under
//! one setting may not fit under another, so the exports name it.

/// The variable PyTorch reads its CUDA allocator's setting from, once, when CUDA starts.
pub const VARIABLE: &str = "PYTORCH_CUDA_ALLOC_CONF";

/// The setting with expandable segments.
pub const EXPANDABLE_SEGMENTS: &str = "expandable_segments:True";

/// What [`VARIABLE`] holds for `setting` as recorded: the setting, or `None` (the variable
/// removed) for PyTorch's default, which is recorded empty.
pub fn variable_value(setting: &str) -> Option<String> {
    (!setting.is_empty()).then(|| setting.to_string())
}

/// The environment line that reproduces `setting` (a value of [`VARIABLE`] as recorded; empty
/// for PyTorch's default, which needs no line).
pub fn environment_line(setting: &str) -> Option<String> {
    variable_value(setting).map(|value| format!("{VARIABLE}={value}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_setting_other_than_the_default_needs_a_line() {
        assert_eq!(
            environment_line(EXPANDABLE_SEGMENTS).as_deref(),
            Some("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        );
        assert_eq!(environment_line(""), None);
    }
}
