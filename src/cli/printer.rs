//! The one place that decides what goes where: data on stdout, people's messages on stderr.
//!
//! With `--json` stdout carries exactly one JSON document; progress bars appear only on an
//! interactive stderr and never in quiet or JSON mode.

use std::io::{IsTerminal, Write};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Output policy chosen from the global flags.
#[derive(Debug, Clone, Copy)]
pub struct Printer {
    quiet: bool,
    verbose: bool,
    json: bool,
}

impl Printer {
    pub fn new(quiet: bool, verbose: bool, json: bool) -> Self {
        Self {
            quiet,
            verbose,
            json,
        }
    }

    /// A status line for people (stderr), unless quiet.
    pub fn status(&self, message: impl AsRef<str>) {
        if !self.quiet {
            let _ = writeln!(std::io::stderr(), "{}", message.as_ref());
        }
    }

    /// A secondary status line (stderr), shown only with `-v`.
    pub fn detail(&self, message: impl AsRef<str>) {
        if self.verbose && !self.quiet {
            let _ = writeln!(std::io::stderr(), "{}", message.as_ref());
        }
    }

    /// A warning (stderr), shown even when quiet.
    pub fn warn(&self, message: impl AsRef<str>) {
        let _ = writeln!(std::io::stderr(), "warning: {}", message.as_ref());
    }

    /// Something the user must still do or know about the output, on stderr.
    pub fn note(&self, message: impl AsRef<str>) {
        let _ = writeln!(std::io::stderr(), "note: {}", message.as_ref());
    }

    /// Human-readable result text on stdout (not in JSON mode).
    pub fn data_text(&self, text: impl AsRef<str>) {
        if !self.json {
            let _ = writeln!(std::io::stdout(), "{}", text.as_ref());
        }
    }

    /// A document in another format than JSON (a YAML config) on stdout, in either mode: the
    /// command's whole output.
    pub fn document(&self, text: impl AsRef<str>) {
        let _ = writeln!(std::io::stdout(), "{}", text.as_ref());
    }

    /// The JSON document on stdout (only in JSON mode).
    pub fn data_json<T: serde::Serialize>(&self, value: &T) {
        if self.json {
            let text = serde_json::to_string_pretty(value).expect("output types always serialise");
            let _ = writeln!(std::io::stdout(), "{text}");
        }
    }

    /// The JSON document on stdout as a single line (only in JSON mode), for JSON-lines logs.
    pub fn data_json_line<T: serde::Serialize>(&self, value: &T) {
        if self.json {
            let text = serde_json::to_string(value).expect("output types always serialise");
            let _ = writeln!(std::io::stdout(), "{text}");
        }
    }

    /// Whether stdout is reserved for one JSON document.
    pub fn is_json(&self) -> bool {
        self.json
    }

    /// Whether a live progress bar can be drawn.
    pub fn interactive(&self) -> bool {
        !self.quiet && !self.json && std::io::stderr().is_terminal()
    }

    /// Whether periodic progress lines should be logged (stderr is not a terminal).
    pub fn log_progress(&self) -> bool {
        !self.quiet && !std::io::stderr().is_terminal()
    }

    /// A spinner with a message on stderr, hidden when output is not interactive.
    pub fn spinner(&self) -> ProgressBar {
        let bar = ProgressBar::with_draw_target(
            None,
            if self.interactive() {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        if let Ok(style) = ProgressStyle::with_template("{spinner} {elapsed} {msg}") {
            bar.set_style(style);
        }
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        bar
    }

    /// A progress bar on stderr, hidden when output is not interactive.
    pub fn progress(&self, len: u64, template: &str) -> ProgressBar {
        let bar = ProgressBar::with_draw_target(
            Some(len),
            if self.interactive() {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        Self::restyle(&bar, template);
        bar
    }

    /// Draws `bar` with `template` from now on.
    pub fn restyle(bar: &ProgressBar, template: &str) {
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("=> "));
        }
    }
}
