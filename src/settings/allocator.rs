//! `--allocator`: which PyTorch CUDA allocator setting a trial runner's trials run under, given
//! to the runner as `PYTORCH_CUDA_ALLOC_CONF` (see [`crate::trial_protocol::allocator`]).

use crate::trial_protocol::allocator::EXPANDABLE_SEGMENTS;

/// PyTorch's CUDA allocator settings a search can run its runner's trials under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Allocator {
    /// Expandable segments (`expandable_segments:True`): memory grows with the batch.
    ExpandableSegments,
    /// PyTorch's default caching allocator (`PYTORCH_CUDA_ALLOC_CONF` unset), whose block
    /// splitting can make a batch run out of memory where a larger one fits.
    PytorchDefault,
}

/// The `PYTORCH_CUDA_ALLOC_CONF` a runner's trials run under, empty for PyTorch's default (the
/// variable removed): the setting `asked`; else the one this process's `environment` holds,
/// which is the user's choice for their training too; else expandable segments, under which a
/// search's boundary is one that training under the same setting meets.
pub fn runner_allocator(asked: Option<Allocator>, environment: Option<&str>) -> String {
    match (asked, environment) {
        (Some(Allocator::ExpandableSegments), _) => EXPANDABLE_SEGMENTS.into(),
        (Some(Allocator::PytorchDefault), _) => String::new(),
        (None, Some(own)) => own.trim().into(),
        (None, None) => EXPANDABLE_SEGMENTS.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_wins_then_the_environment_then_expandable_segments() {
        let cases: [(Option<Allocator>, Option<&str>, &str); 6] = [
            (None, None, EXPANDABLE_SEGMENTS),
            (None, Some("max_split_size_mb:128"), "max_split_size_mb:128"),
            (None, Some(""), ""),
            (Some(Allocator::PytorchDefault), None, ""),
            (
                Some(Allocator::PytorchDefault),
                Some(EXPANDABLE_SEGMENTS),
                "",
            ),
            (
                Some(Allocator::ExpandableSegments),
                Some("backend:cudaMallocAsync"),
                EXPANDABLE_SEGMENTS,
            ),
        ];
        for (asked, environment, expected) in cases {
            assert_eq!(
                runner_allocator(asked, environment),
                expected,
                "{asked:?} {environment:?}"
            );
        }
    }
}
