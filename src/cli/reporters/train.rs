//! How a training session reads for people: a progress bar (or, when stderr is not a
//! terminal, a line every tenth of the run), the session's notices, and the line that says how
//! the run ended.

use autotune::data::load::LoadEvent;
use autotune::session::observer::{Notice, SessionObserver};
use autotune::train::run::{MemorySample, RunSummary, TrainEvent, TrainObserver};

use super::bytes;
use crate::cli::printer::Printer;

/// How the bar reads while training steps.
const STEPS: &str = "{bar:30} {pos}/{len} steps  {msg}  ETA {eta}";
/// How the bar reads while a dataset is tokenized.
const RECORDS: &str = "{bar:30} {pos}/{len} records tokenized  ETA {eta}";

/// A training run's progress on stderr.
pub struct TrainProgress {
    bar: indicatif::ProgressBar,
    /// When tokenizing began, while it goes on.
    tokenizing: std::cell::Cell<Option<std::time::Instant>>,
    printer: Printer,
    /// Steps between the lines logged when stderr is no terminal: a tenth of the run.
    log_every: std::cell::Cell<u64>,
    /// The first step this run takes: its line is always logged, so a log shows at once that
    /// training started (and a watcher can wait for it).
    first_step: std::cell::Cell<u64>,
}

impl TrainProgress {
    /// Progress of a run of `total` steps.
    pub fn new(printer: &Printer, total: u64) -> Self {
        let bar = printer.progress(total, STEPS);
        Self {
            bar,
            tokenizing: std::cell::Cell::new(None),
            printer: *printer,
            log_every: std::cell::Cell::new((total / 10).max(1)),
            first_step: std::cell::Cell::new(1),
        }
    }

    /// Clears the bar once the run is over.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }

    fn status(&self, line: String) {
        self.bar.suspend(|| self.printer.status(line));
    }

    fn step(
        &self,
        step: u64,
        report: &autotune::train::step::StepReport,
        tokens_per_s: f64,
        memory: &MemorySample,
    ) {
        let skipped = if report.skipped {
            " (skipped: fp16 overflow)"
        } else {
            ""
        };
        let msg = format!(
            "loss {:.4}  {tokens_per_s:.0} tok/s  lr {:.3e}{}{skipped}",
            report.loss,
            report.lr,
            memory_phrase(memory)
        );
        self.bar.set_position(step);
        self.bar.set_message(msg.clone());
        let due = step % self.log_every.get() == 0 || step == self.first_step.get();
        if self.printer.log_progress() && due {
            self.printer.status(format!("step {step}: {msg}"));
        }
    }
}

/// Memory for the progress line: the GPU's in use and at most so far, or on the CPU the host
/// heap's (nothing where the heap is not counted).
fn memory_phrase(memory: &MemorySample) -> String {
    match (memory.gpu_bytes, memory.gpu_peak_bytes) {
        (Some(now), Some(peak)) => format!("  GPU {} (peak {})", bytes(now), bytes(peak)),
        _ if memory.host_peak_bytes > 0 => format!(
            "  host {} (peak {})",
            bytes(memory.host_bytes),
            bytes(memory.host_peak_bytes)
        ),
        _ => String::new(),
    }
}

impl TrainObserver for TrainProgress {
    fn on_event(&self, event: &TrainEvent) {
        match event {
            TrainEvent::Started {
                start_step,
                total_steps,
            } => {
                // A run of epochs knows its length only once its data is open.
                Printer::restyle(&self.bar, STEPS);
                self.bar.set_length(*total_steps);
                self.log_every.set((total_steps / 10).max(1));
                self.bar.set_position(*start_step);
                self.first_step.set(start_step.saturating_add(1));
                if *start_step > 0 {
                    self.printer
                        .status(format!("resuming at step {start_step}"));
                }
            }
            TrainEvent::Step {
                step,
                report,
                tokens_per_s,
                memory,
                eval_loss,
            } => {
                self.step(*step, report, *tokens_per_s, memory);
                if let Some(loss) = eval_loss {
                    self.status(format!(
                        "step {step}: eval loss {loss:.4}, perplexity {:.2}",
                        loss.exp()
                    ));
                }
            }
            TrainEvent::CheckpointSaved { step, path } => {
                tracing::debug!(step, path = %path.display(), "checkpoint saved");
            }
        }
    }
}

impl SessionObserver for TrainProgress {
    fn notice(&self, notice: Notice) {
        match notice {
            Notice::Loading(event) => self.loading(event),
            Notice::MetricsDropped { .. } | Notice::PlanDataDiffers { .. } => {
                let line = notice_line(&notice);
                self.bar.suspend(|| self.printer.warn(line))
            }
            _ => self.status(notice_line(&notice)),
        }
    }
}

impl TrainProgress {
    /// Shows a dataset's loading: the bar counts records while they are tokenized.
    fn loading(&self, event: LoadEvent) {
        match &event {
            LoadEvent::Tokenizing { total } => {
                self.tokenizing.set(Some(std::time::Instant::now()));
                Printer::restyle(&self.bar, RECORDS);
                self.bar.set_length(*total as u64);
                self.bar.set_position(0);
            }
            LoadEvent::Tokenized { done } => {
                self.bar.set_position(*done as u64);
                return;
            }
            LoadEvent::Cached { .. } => {
                if let Some(started) = self.tokenizing.take() {
                    let took = started.elapsed().as_secs_f64();
                    self.status(format!("tokenized in {took:.1} s"));
                }
            }
            LoadEvent::CacheSkipped { .. } => {
                let line = load_line(&event);
                self.bar.suspend(|| self.printer.warn(line));
                return;
            }
            LoadEvent::FromCache { .. } => {}
        }
        self.status(load_line(&event));
    }
}

/// Runs `work`, drawing the dataset loading it reports as status lines and a bar of the
/// records tokenized.
pub fn with_load_progress<T>(printer: &Printer, work: impl FnOnce(&dyn Fn(LoadEvent)) -> T) -> T {
    let bar = printer.progress(0, "{bar:30} {pos}/{len} records tokenized  ETA {eta}");
    let done = work(&|event| match &event {
        LoadEvent::Tokenizing { total } => {
            bar.set_length(*total as u64);
            bar.suspend(|| printer.status(load_line(&event)));
        }
        LoadEvent::Tokenized { done } => bar.set_position(*done as u64),
        _ => bar.suspend(|| printer.status(load_line(&event))),
    });
    bar.finish_and_clear();
    done
}

/// A dataset's loading as the line people read.
pub fn load_line(event: &LoadEvent) -> String {
    match event {
        LoadEvent::Tokenizing { total } => format!(
            "tokenizing {total} records on {} threads",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        ),
        LoadEvent::Tokenized { done } => format!("{done} records tokenized"),
        LoadEvent::Cached { path } => format!(
            "the examples are cached in {} for the next run",
            path.display()
        ),
        LoadEvent::FromCache { path, examples } => format!(
            "{examples} examples from the token cache {}",
            path.display()
        ),
        LoadEvent::CacheSkipped { reason } => format!("the token cache is not used: {reason}"),
    }
}

/// A notice as the line people read.
pub fn notice_line(notice: &Notice) -> String {
    match notice {
        Notice::Training {
            model,
            parameters,
            device,
            knobs,
            data,
            lr,
            schedule,
        } => format!(
            "training {model} ({:.1}M parameters) on {device} with {knobs}, data {data}, learning rate {lr} ({schedule})",
            *parameters as f64 / 1e6
        ),
        Notice::SweptTemporaries { count, dir } => format!(
            "removed {count} temporary file(s) an interrupted save left in {}",
            dir.display()
        ),
        Notice::Overwrote { dir } => {
            format!("--overwrite: removed the checkpoints in {}", dir.display())
        }
        Notice::Launching {
            ranks,
            cuda,
            backend,
        } => format!(
            "data parallel: {ranks} ranks on {}, {backend} collectives",
            if *cuda { "cuda:0.." } else { "the cpu" },
        ),
        Notice::RankStarted { rank, pid } => format!("rank {rank}: started, pid {pid}"),
        Notice::RankLog { rank, line } => format!("rank {rank}: {line}"),
        Notice::MetricsDropped { path, problem } => format!(
            "{problem}; training goes on without the metrics log `{}`",
            path.display()
        ),
        Notice::PlanDataDiffers { what } => format!(
            "the plan {what}; training anyway (--allow-data-mismatch), though its memory was \
             measured on other batches"
        ),
        Notice::Examples(cut) => format!(
            "{} examples ({} cut to the sequence length, {} dropped with nothing to train on), \
             {} tokens, {} of them trained on ({:.0}%)",
            cut.kept,
            cut.truncated,
            cut.dropped,
            cut.tokens,
            cut.trained_tokens,
            100.0 * cut.trained_tokens as f64 / cut.tokens.max(1) as f64
        ),
        Notice::Loading(event) => load_line(event),
        Notice::ResumingRun { dir } => format!(
            "resuming the run in {} with its plan (the tuning flags are not used)",
            dir.display()
        ),
    }
}

/// The line that says how a run ended: finished or interrupted at a step, with its losses, its
/// speed and its last checkpoint; or where it diverged and what was kept.
pub fn finished(printer: &Printer, summary: &RunSummary) {
    if let Some(d) = &summary.diverged {
        let kept = summary
            .checkpoint
            .as_ref()
            .map(|c| format!("; the last good checkpoint is {}", c.display()))
            .unwrap_or_default();
        printer.status(format!(
            "diverged at step {}: {} is not finite, so nothing more was saved{kept}; lower the learning rate, or resume from an earlier checkpoint",
            d.step, d.what
        ));
        return;
    }
    let verb = if summary.interrupted {
        "interrupted at"
    } else {
        "finished"
    };
    let loss = summary.last_loss.map_or("-".into(), |l| format!("{l:.4}"));
    let eval = summary
        .last_eval_loss
        .map(|l| format!(", eval loss {l:.4}"))
        .unwrap_or_default();
    let checkpoint = summary
        .checkpoint
        .as_ref()
        .map(|c| format!(", checkpoint {}", c.display()))
        .unwrap_or_default();
    // Padding counts in tokens/s; say how much of it was real where they differ.
    let real = if summary.real_tokens_per_s < summary.tokens_per_s * 0.999 {
        format!(" ({:.0} of examples)", summary.real_tokens_per_s)
    } else {
        String::new()
    };
    printer.status(format!(
        "{verb} step {}: loss {loss}{eval}, {:.0} tokens/s{real}{checkpoint}",
        summary.steps, summary.tokens_per_s
    ));
}
