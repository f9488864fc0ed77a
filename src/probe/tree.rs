//! Every process a trial runner started, wherever it went: each runner is started with a mark
//! of its own in its environment ([`TREE_VARIABLE`]), which every process it starts inherits,
//! and [`ProcessTree::kill`] kills every process that carries it.
//!
//! The runner's process group alone does not hold its tree: a process that calls `setsid`
//! (a daemonising library, `subprocess.Popen(start_new_session=True)`) leaves the group, and
//! would outlive the trial holding GPU memory. An environment mark survives `setsid`, `fork`
//! and `exec`. A subreaper (`PR_SET_CHILD_SUBREAPER`) would adopt such orphans into autotune,
//! but could not tell them from the other children of the process it is set on (a test
//! process runs many probers at once), so it would not say which to kill; cgroups need a
//! delegated hierarchy that most hosts do not give. Only a process that starts with an emptied
//! environment escapes the mark; the runner's process group still catches it while it stays
//! in the group. Where there is no `/proc` (not Linux), the group is all that is killed.

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable that marks a runner's processes.
pub const TREE_VARIABLE: &str = "AUTOTUNE_RUNNER_TREE";

/// How many times the processes are looked for: a process may fork between a scan and its
/// kill, and its child is found by the next scan.
const MAX_SCANS: usize = 16;

/// The processes of one runner, marked by a value no other runner has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessTree {
    /// `TREE_VARIABLE=value` and the NUL that ends it in `/proc/PID/environ`.
    entry: Vec<u8>,
}

impl ProcessTree {
    /// A tree with a new mark: this process's id and a count, unique on this host while
    /// autotune runs.
    pub fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let value = format!(
            "{}.{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        Self {
            entry: format!("{TREE_VARIABLE}={value}\0").into_bytes(),
        }
    }

    /// Marks the process `command` starts, and so everything it starts.
    pub fn mark(&self, command: &mut Command) {
        let entry = String::from_utf8_lossy(&self.entry);
        if let Some((name, value)) = entry.trim_end_matches('\0').split_once('=') {
            command.env(name, value);
        }
    }

    /// Kills every process of the tree that is still running (SIGKILL); returns how many.
    pub fn kill(&self) -> usize {
        let mut killed = 0;
        for _ in 0..MAX_SCANS {
            let marked = self.marked_pids();
            if marked.is_empty() {
                break;
            }
            for pid in marked {
                // Gone already is fine: it ended between the scan and now.
                if rustix::process::kill_process(pid, rustix::process::Signal::KILL).is_ok() {
                    killed += 1;
                }
            }
        }
        killed
    }

    /// The processes whose environment carries the mark (a process that has exited and waits
    /// to be reaped has no environment left, so it is not found again).
    fn marked_pids(&self) -> Vec<rustix::process::Pid> {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        let own = std::process::id();
        entries
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&pid| pid != own)
            .filter(|pid| {
                // Unreadable (another user's process, or one gone since): not ours.
                std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|environ| self.is_in(&environ))
            })
            .filter_map(|pid| rustix::process::Pid::from_raw(i32::try_from(pid).ok()?))
            .collect()
    }

    /// Whether `environ` (NUL-separated `NAME=value` entries) holds the mark.
    fn is_in(&self, environ: &[u8]) -> bool {
        environ
            .split_inclusive(|&b| b == 0)
            .any(|entry| entry == self.entry.as_slice())
    }
}

impl Default for ProcessTree {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_is_found_only_as_a_whole_entry_and_differs_between_trees() {
        let tree = ProcessTree::new();
        let entry = tree.entry.clone();
        let mut environ = b"PATH=/bin\0".to_vec();
        environ.extend_from_slice(&entry);
        environ.extend_from_slice(b"HOME=/root\0");
        assert!(tree.is_in(&environ));
        let mut longer = entry[..entry.len() - 1].to_vec();
        longer.extend_from_slice(b"0\0");
        assert!(!tree.is_in(&longer), "another tree's mark with more digits");
        assert!(!tree.is_in(b"PATH=/bin\0"));
        assert_ne!(ProcessTree::new(), tree);
    }
}
