//! A process that outlives a killed autotune to stop its trial runner
//! (`autotune runner-watchdog`).
//!
//! A runner runs in a process group of its own, so that its whole tree can be killed after a
//! trial and on an interrupt ([`super::runner`]). An autotune killed by a signal it cannot
//! handle (SIGKILL: an out-of-memory killer, a job scheduler's hard stop) kills nothing, and the
//! runner would go on holding the GPU's memory, which the next tune on the card then lacks. The
//! kernel's parent-death signal reaches only the runner's first process, not what it started.
//!
//! So a tune through a runner starts this watchdog first, in a process group of its own (a
//! terminal's signals reach autotune alone), and tells it on its standard input which runner
//! is running (`hold PGID MARK`) and when it is gone (`release PGID`). The watchdog does
//! nothing else until its input ends. That happens when autotune exits, however it ended: then
//! it kills every runner still held, with its whole tree (the group, and every process that
//! carries the runner's mark, [`ProcessTree`]), and exits itself.

use std::io::{BufRead, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;

use super::tree::ProcessTree;
use crate::{Error, Result};

/// The subcommand that runs a watchdog.
pub const SUBCOMMAND: &str = "runner-watchdog";

/// The parent's side: a started watchdog, told of each runner as it starts and ends.
#[derive(Debug)]
pub struct Watchdog {
    child: Child,
    input: Mutex<Option<ChildStdin>>,
}

impl Watchdog {
    /// Starts `program runner-watchdog` (an autotune executable) in a process group of its own.
    pub fn start(program: &Path) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let mut child = Command::new(program)
            .arg(SUBCOMMAND)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .process_group(0)
            .spawn()
            .map_err(|e| Error::file("cannot start the runner watchdog", program, e))?;
        let input = child.stdin.take();
        Ok(Self {
            child,
            input: Mutex::new(input),
        })
    }

    /// Tells the watchdog that runner `pgid`, marked as `tree`, is running.
    pub fn holding(&self, pgid: i32, tree: &ProcessTree) {
        self.tell(&Notice::Hold(pgid, tree.mark_value().to_string()));
    }

    /// Tells the watchdog that runner `pgid` is gone.
    pub fn released(&self, pgid: i32) {
        self.tell(&Notice::Release(pgid));
    }

    fn tell(&self, notice: &Notice) {
        if let Ok(mut input) = self.input.lock() {
            // A watchdog that is gone cannot be told; the runner is still killed by autotune
            // itself wherever it ends normally.
            let written = input
                .as_mut()
                .map(|pipe| writeln!(pipe, "{}", notice.line()).and_then(|()| pipe.flush()));
            if matches!(written, Some(Err(_))) {
                *input = None;
            }
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // Its input ends: it kills whatever is still held (nothing, after a normal end) and
        // exits.
        if let Ok(mut input) = self.input.lock() {
            input.take();
        }
        let _ = self.child.wait();
    }
}

/// One line of the watchdog's input.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Notice {
    /// `hold PGID MARK`: runner `PGID`, whose processes carry `MARK`, is running.
    Hold(i32, String),
    /// `release PGID`: runner `PGID` is gone.
    Release(i32),
}

impl Notice {
    fn line(&self) -> String {
        match self {
            Notice::Hold(pgid, mark) => format!("hold {pgid} {mark}"),
            Notice::Release(pgid) => format!("release {pgid}"),
        }
    }

    /// A line as [`Notice::line`] writes it; `None` for anything else.
    fn parse(line: &str) -> Option<Self> {
        let mut words = line.split_whitespace();
        let notice = match (words.next()?, words.next()?.parse().ok()?, words.next()) {
            ("hold", pgid, Some(mark)) if pgid > 0 => Notice::Hold(pgid, mark.to_string()),
            ("release", pgid, None) => Notice::Release(pgid),
            _ => return None,
        };
        words.next().is_none().then_some(notice)
    }
}

/// The runners still held once `input` ends: each `hold` adds one, its `release` removes it.
/// A line that is not a notice is skipped: the watchdog stays on guard.
fn held_at_end(input: impl BufRead) -> Vec<(i32, String)> {
    let mut held: Vec<(i32, String)> = Vec::new();
    for line in input.lines() {
        let Ok(line) = line else {
            break;
        };
        match Notice::parse(&line) {
            Some(Notice::Hold(pgid, mark)) => {
                held.retain(|(p, _)| *p != pgid);
                held.push((pgid, mark));
            }
            Some(Notice::Release(pgid)) => held.retain(|(p, _)| *p != pgid),
            None => {}
        }
    }
    held
}

/// The watchdog's side: follows the notices on standard input until it ends, then kills every
/// runner still held, with its tree and group.
pub fn serve() {
    for (pgid, mark) in held_at_end(std::io::stdin().lock()) {
        ProcessTree::with_mark_value(&mark).kill_with_group(pgid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runners_held_when_the_input_ends_are_those_not_yet_released() {
        // (input, held at its end)
        let cases: [(&str, &[(i32, &str)]); 6] = [
            ("", &[]),
            ("hold 7 1.1\n", &[(7, "1.1")]),
            ("hold 7 1.1\nrelease 7\n", &[]),
            ("hold 7 1.1\nhold 9 1.2\nrelease 7\n", &[(9, "1.2")]),
            // Not notices: skipped, the hold before them stands.
            (
                "hold 7 1.1\nrelease\nhold -3 x\nhold 8\nrelease 7 extra\n",
                &[(7, "1.1")],
            ),
            // A release of another runner leaves this one held.
            ("hold 7 1.1\nrelease 8\n", &[(7, "1.1")]),
        ];
        for (input, expected) in cases {
            let held = held_at_end(input.as_bytes());
            let expected: Vec<(i32, String)> =
                expected.iter().map(|&(p, m)| (p, m.to_string())).collect();
            assert_eq!(held, expected, "{input:?}");
        }
    }

    #[test]
    fn every_notice_reads_back_as_written() {
        for notice in [Notice::Hold(42, "17.3".into()), Notice::Release(42)] {
            assert_eq!(Notice::parse(&notice.line()), Some(notice));
        }
    }
}
