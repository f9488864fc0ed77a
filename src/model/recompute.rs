//! Activation checkpointing as the engines see it: which blocks keep only their input in the
//! forward pass and run again in the backward pass.

use crate::knobs::Checkpointing;

/// Which Transformer blocks are recomputed in the backward pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecomputedBlocks {
    recompute: Vec<bool>,
}

impl RecomputedBlocks {
    /// The blocks `checkpointing` recomputes among `n_layers`.
    pub fn new(checkpointing: Checkpointing, n_layers: usize) -> Self {
        Self {
            recompute: (0..n_layers).map(|i| checkpointing.recomputes(i)).collect(),
        }
    }

    /// Whether block `index` is recomputed.
    pub fn recomputes(&self, index: usize) -> bool {
        self.recompute.get(index).copied().unwrap_or(false)
    }

    /// How many blocks are recomputed (each costs one more block forward per micro-batch).
    pub fn count(&self) -> usize {
        self.recompute.iter().filter(|&&r| r).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_follow_checkpointing() {
        let all = RecomputedBlocks::new(Checkpointing::EveryKth(1), 4);
        assert_eq!(all.count(), 4);
        let every2 = RecomputedBlocks::new(Checkpointing::EveryKth(2), 5);
        let picked: Vec<usize> = (0..5).filter(|&i| every2.recomputes(i)).collect();
        assert_eq!(picked, vec![0, 2, 4]);
        assert_eq!(RecomputedBlocks::new(Checkpointing::None, 3).count(), 0);
        assert!(!all.recomputes(7), "blocks past the end are not recomputed");
    }
}
