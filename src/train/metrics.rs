//! The per-step metrics log: one JSON object per line, per optimizer step, for plotting and
//! dashboards (TensorBoard and W&B importers read JSON lines). The format is published as a
//! JSON Schema in `docs/metrics.schema.json`:
//!
//! | field | type | meaning |
//! |---|---|---|
//! | `step` | integer | Optimizer steps completed, counting resumed ones (the first line is step 1). |
//! | `loss` | number or null | Mean training loss of the step (`null` when not finite). |
//! | `tokens_per_s` | number | Tokens of the step (all ranks) per second of it. |
//! | `real_tokens_per_s` | number, optional | Of those, the tokens of examples (not padding), where the step had padding. |
//! | `lr` | number | The learning rate the step ran at. |
//! | `loss_scale` | number | The fp16 loss scale after the step (1 otherwise). |
//! | `skipped` | boolean | Whether the step's update was skipped (an fp16 overflow). |
//! | `gpu_bytes`, `gpu_peak_bytes` | integer or null | Device memory in use after the step and the most so far (`null` on the CPU). |
//! | `host_bytes`, `host_peak_bytes` | integer | Host heap in use after the step and the most so far. |
//! | `unix_time_s` | number | When the step ended, seconds since the Unix epoch. |
//!
//! A resumed run continues the log of the run it resumes: lines past the checkpoint's step
//! (steps the interrupted run took after its last checkpoint, which the resumed run takes
//! again) are dropped first.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::train::run::MemorySample;
use crate::train::step::StepReport;
use crate::{Error, Result};

/// One line of the log.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepLine {
    /// Optimizer steps completed.
    pub step: u64,
    /// Mean training loss of the step; `None` (JSON `null`) when it is not finite.
    pub loss: Option<f64>,
    /// Tokens per second of the step.
    pub tokens_per_s: f64,
    /// Of those, the tokens of examples (not padding) per second, where the step had padding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub real_tokens_per_s: Option<f64>,
    /// Learning rate of the step.
    pub lr: f64,
    /// Loss scale after the step.
    pub loss_scale: f64,
    /// Whether an fp16 overflow skipped the update.
    pub skipped: bool,
    /// Device bytes in use after the step.
    pub gpu_bytes: Option<u64>,
    /// The most device bytes in use so far.
    pub gpu_peak_bytes: Option<u64>,
    /// Host heap bytes in use after the step.
    pub host_bytes: u64,
    /// The most host heap bytes so far.
    pub host_peak_bytes: u64,
    /// When the step ended, seconds since the Unix epoch.
    pub unix_time_s: f64,
    /// The held-out loss after the step, on the steps that evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// Its perplexity, `exp(eval_loss)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_ppl: Option<f64>,
}

impl StepLine {
    /// The line of step `step`, which did `report` at `tokens_per_s`, ending at `unix_time_s`
    /// with `memory` in use.
    pub fn new(
        step: u64,
        report: &StepReport,
        tokens_per_s: f64,
        memory: &MemorySample,
        unix_time_s: f64,
    ) -> Self {
        Self {
            step,
            loss: report.loss.is_finite().then_some(report.loss),
            tokens_per_s,
            real_tokens_per_s: (report.real_tokens < report.tokens)
                .then(|| tokens_per_s * report.real_tokens as f64 / report.tokens.max(1) as f64),
            lr: report.lr,
            loss_scale: report.loss_scale,
            skipped: report.skipped,
            gpu_bytes: memory.gpu_bytes,
            gpu_peak_bytes: memory.gpu_peak_bytes,
            host_bytes: memory.host_bytes,
            host_peak_bytes: memory.host_peak_bytes,
            unix_time_s,
            eval_loss: None,
            eval_ppl: None,
        }
    }

    /// The line with the held-out loss `eval_loss` (and its perplexity) when the step evaluated;
    /// a loss that is not finite is left out.
    pub fn with_eval(mut self, eval_loss: Option<f64>) -> Self {
        if let Some(loss) = eval_loss.filter(|l| l.is_finite()) {
            self.eval_loss = Some(loss);
            self.eval_ppl = Some(loss.exp());
        }
        self
    }
}

/// The log file, held by one run at a time: locked when created, started (or continued) when
/// the run starts.
///
/// Two runs appending to one file would interleave their lines into a log neither can be
/// plotted from, so the file is locked (an advisory `flock`, which the operating system
/// releases when the process ends, however it ends) for as long as the log is open, and a
/// second run is refused. The lock sits on the file itself, so the file is rewritten in place,
/// never replaced by a rename (a lock on a replaced file guards nothing).
pub struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
    started: bool,
}

impl MetricsLog {
    /// A log at `path`, which must be a file this process can write (it is created if
    /// missing; nothing in it changes until [`MetricsLog::start`]) and no other run writes.
    pub fn new(path: &Path) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .map_err(|e| Error::file("cannot write metrics log", path, e))?;
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                return Err(autotune_core::Error::InvalidFlag {
                    flag: format!("--metrics {}", path.display()),
                    problem: "is being written by another autotune run, and two runs in one \
                              log interleave their lines; give this run its own --metrics \
                              file, or wait for the other run to end"
                        .into(),
                }
                .into())
            }
            Err(e) => {
                return Err(Error::file(
                    "cannot lock metrics log",
                    path,
                    std::io::Error::from(e),
                ))
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            started: false,
        })
    }

    /// Starts the log of a run whose first step is `start_step + 1`: a fresh run empties the
    /// file, a resumed one keeps the lines up to `start_step` and drops the rest.
    pub fn start(&mut self, start_step: u64) -> Result<()> {
        let cannot = |e| Error::file("cannot write metrics log", &self.path, e);
        let mut text = String::new();
        if start_step > 0 {
            (&self.file).seek(SeekFrom::Start(0)).map_err(cannot)?;
            (&self.file).read_to_string(&mut text).map_err(cannot)?;
        }
        let kept: String = text
            .lines()
            .filter(|line| {
                serde_json::from_str::<StepLine>(line).is_ok_and(|l| l.step <= start_step)
            })
            .flat_map(|line| [line, "\n"])
            .collect();
        // Usually the kept lines are the file's start: cutting the rest is one atomic step.
        if text.starts_with(&kept) {
            self.file.set_len(kept.len() as u64).map_err(cannot)?;
        } else {
            self.file.set_len(0).map_err(cannot)?;
            // Appends: the file is open for appending, so this lands at its (new) start.
            self.file.write_all(kept.as_bytes()).map_err(cannot)?;
        }
        self.started = true;
        Ok(())
    }

    /// Appends `line` (one write, so a reader never sees half of it).
    pub fn write(&mut self, line: &StepLine) -> Result<()> {
        if !self.started {
            return Err(Error::internal(
                "the metrics log was written before the run started",
            ));
        }
        let mut text = serde_json::to_string(line).expect("a metrics line always serialises");
        text.push('\n');
        self.file
            .write_all(text.as_bytes())
            .map_err(|e| Error::file("cannot write metrics log", &self.path, e))
    }

    /// Where the log is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Every step of `text`, the log read from `path`, in order; a line that is no step is an
/// error naming the file and the line.
pub fn parse_log(text: &str, path: &Path) -> Result<Vec<StepLine>> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str::<StepLine>(line).map_err(|e| {
                Error::Usage(format!(
                    "`{}` line {}: not a step of a metrics log ({e}); give the file a run wrote \
                     with --metrics",
                    path.display(),
                    i + 1
                ))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(step: u64) -> StepLine {
        StepLine {
            step,
            loss: Some(1.0 / step as f64),
            tokens_per_s: 100.0,
            real_tokens_per_s: None,
            lr: 1e-3,
            loss_scale: 1.0,
            skipped: false,
            gpu_bytes: None,
            gpu_peak_bytes: None,
            host_bytes: 10,
            host_peak_bytes: 20,
            unix_time_s: 1.7e9,
            eval_loss: None,
            eval_ppl: None,
        }
    }

    fn steps(path: &Path) -> Vec<u64> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<StepLine>(l).unwrap().step)
            .collect()
    }

    #[test]
    fn a_fresh_run_starts_the_log_and_a_resumed_one_continues_from_its_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        std::fs::write(&path, "left by another run\n").unwrap();
        let mut log = MetricsLog::new(&path).unwrap();
        assert!(log.write(&line(1)).is_err(), "not started");
        log.start(0).unwrap();
        for step in 1..=7 {
            log.write(&line(step)).unwrap();
        }
        assert_eq!(steps(&path), (1..=7).collect::<Vec<_>>());
        let err = MetricsLog::new(&path)
            .err()
            .expect("a second writer is refused");
        assert!(err.to_string().contains("another autotune run"), "{err}");
        drop(log);
        // The run saved at step 5, took two more steps and was stopped; resuming from 5
        // takes steps 6 and 7 again.
        let mut resumed = MetricsLog::new(&path).unwrap();
        resumed.start(5).unwrap();
        assert_eq!(steps(&path), (1..=5).collect::<Vec<_>>());
        resumed.write(&line(6)).unwrap();
        assert_eq!(steps(&path), (1..=6).collect::<Vec<_>>());
    }

    #[test]
    fn a_loss_that_is_not_finite_is_null() {
        let report = StepReport {
            loss: f64::NAN,
            skipped: false,
            loss_scale: 1.0,
            tokens: 8,
            real_tokens: 8,
            lr: 0.1,
        };
        let line = StepLine::new(3, &report, 1.0, &MemorySample::default(), 0.0);
        let json = serde_json::to_value(line).unwrap();
        assert_eq!(json["loss"], serde_json::Value::Null);
        assert!(MetricsLog::new(Path::new("/nonexistent/dir/metrics.jsonl")).is_err());
    }
}
