//! What a training rank tells its launcher: one JSON object per line on the rank's stdout.
//!
//! Rank 0 sends every [`TrainEvent`] as it happens, so the launcher can draw progress; every
//! rank sends its [`RunSummary`] last, so the launcher can check that the ranks ended in the
//! same state (a rank whose loss differs has diverged, which is a bug, never a result).

use serde::{Deserialize, Serialize};

use crate::train::run::{RunSummary, TrainEvent};

/// One line of a training rank's stdout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "body")]
pub enum RankMessage {
    /// Progress of the run (rank 0 only).
    Train(TrainEvent),
    /// How the run ended on this rank.
    Finished(RunSummary),
}

impl RankMessage {
    /// The message as one line of JSON (no newline).
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("rank messages always serialise")
    }

    /// Parses a line; anything else a rank prints is not a message.
    pub fn parse(line: &str) -> Option<Self> {
        serde_json::from_str(line).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::step::StepReport;

    #[test]
    fn messages_round_trip_as_single_lines() {
        let messages = [
            RankMessage::Train(TrainEvent::Step {
                step: 3,
                report: StepReport {
                    loss: 1.25,
                    skipped: false,
                    loss_scale: 1.0,
                    tokens: 64,
                    real_tokens: 64,
                    lr: 3e-4,
                },
                tokens_per_s: 1e4,
                memory: crate::train::run::MemorySample {
                    gpu_bytes: Some(3 << 30),
                    gpu_peak_bytes: Some(4 << 30),
                    host_bytes: 1 << 20,
                    host_peak_bytes: 2 << 20,
                },

                eval_loss: Some(2.5),
            }),
            RankMessage::Finished(RunSummary {
                steps: 3,
                interrupted: true,
                last_loss: Some(0.1 + 0.2),
                last_eval_loss: None,
                tokens_per_s: 2.5,
                real_tokens_per_s: 2.0,
                skipped_steps: 0,
                checkpoint: Some("ckpt/step-000003".into()),
                diverged: None,
            }),
        ];
        for m in messages {
            let line = m.to_line();
            assert!(!line.contains('\n'));
            assert_eq!(RankMessage::parse(&line), Some(m));
        }
        assert_eq!(RankMessage::parse("warning: not json"), None);
    }
}
