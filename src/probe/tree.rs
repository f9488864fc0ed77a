//! Every process a trial runner started, wherever it went: each runner is started with a mark
//! of its own in its environment ([`TREE_VARIABLE`]), which every process it starts inherits,
//! and [`ProcessTree::kill`] kills every process that carries it, with their children.
//!
//! The runner's process group alone does not hold its tree: a process that calls `setsid`
//! (a daemonising library, `subprocess.Popen(start_new_session=True)`) leaves the group, and
//! would outlive the trial holding GPU memory. An environment mark survives `setsid`, `fork`
//! and `exec`. A subreaper (`PR_SET_CHILD_SUBREAPER`) would adopt such orphans into autotune,
//! but could not tell them from the other children of the process it is set on (a test
//! process runs many probers at once), so it would not say which to kill; cgroups need a
//! delegated hierarchy that most hosts do not give. Only a process that starts with an emptied
//! environment and whose parent has exited escapes the mark; the runner's process group still
//! catches it while it stays in the group. Where there is no `/proc` (not Linux), the group is
//! all that is killed.

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

    /// The tree of the processes that carry the mark `value` (as [`Self::mark_value`] gives
    /// it), for a process other than the one that made the mark (the runner watchdog).
    pub fn with_mark_value(value: &str) -> Self {
        Self {
            entry: format!("{TREE_VARIABLE}={value}\0").into_bytes(),
        }
    }

    /// The mark's value.
    pub fn mark_value(&self) -> &str {
        let entry = std::str::from_utf8(&self.entry).unwrap_or_default();
        entry
            .trim_end_matches('\0')
            .split_once('=')
            .map_or("", |(_, value)| value)
    }

    /// Marks the process `command` starts, and so everything it starts.
    pub fn mark(&self, command: &mut Command) {
        command.env(TREE_VARIABLE, self.mark_value());
    }

    /// Kills every process of the tree of `root` (the runner) that is still running: those
    /// that carry the mark, `root`, and the children of any of them. They are all stopped
    /// first, until a scan finds no other, so that none can start another process or leave
    /// while they are looked for (a child between `fork` and `exec` is found by its parent,
    /// which stays until the kill); then all are killed. Returns how many were.
    pub fn kill(&self, root: i32) -> usize {
        let mut stopped: Vec<i32> = Vec::new();
        for _ in 0..MAX_SCANS {
            let found: Vec<i32> = self
                .members(root)
                .into_iter()
                .filter(|pid| !stopped.contains(pid))
                .collect();
            if found.is_empty() {
                break;
            }
            for &pid in &found {
                signal(pid, rustix::process::Signal::STOP);
            }
            stopped.extend(found);
        }
        stopped
            .iter()
            .filter(|&&pid| signal(pid, rustix::process::Signal::KILL))
            .count()
    }

    /// Kills the tree of `root` ([`Self::kill`]), then `root`'s process group (0: none), which
    /// catches a process that cleared its environment but stayed in the group. Gone already is
    /// fine: the group ended on its own.
    pub fn kill_with_group(&self, root: i32) {
        self.kill(root);
        if let Some(group) = rustix::process::Pid::from_raw(root) {
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
        }
    }

    /// The processes of the tree: those that carry the mark, `root`, and their descendants.
    fn members(&self, root: i32) -> Vec<i32> {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        let own = i32::try_from(std::process::id()).unwrap_or(0);
        let processes: Vec<(i32, i32)> = entries
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&pid| pid != own)
            .filter_map(|pid| Some((pid, parent(pid)?)))
            .collect();
        let mut members: Vec<i32> = processes
            .iter()
            .map(|&(pid, _)| pid)
            .filter(|&pid| pid == root || self.marks(pid))
            .collect();
        // Children of members join, then theirs, until none is left to join.
        loop {
            let joining: Vec<i32> = processes
                .iter()
                .filter(|(pid, ppid)| members.contains(ppid) && !members.contains(pid))
                .map(|&(pid, _)| pid)
                .collect();
            if joining.is_empty() {
                return members;
            }
            members.extend(joining);
        }
    }

    /// Whether process `pid` carries the mark (a process that has exited and waits to be
    /// reaped has no environment left; another user's cannot be read: neither does).
    fn marks(&self, pid: i32) -> bool {
        std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|environ| self.is_in(&environ))
    }

    /// Whether `environ` (NUL-separated `NAME=value` entries) holds the mark.
    fn is_in(&self, environ: &[u8]) -> bool {
        environ
            .split_inclusive(|&b| b == 0)
            .any(|entry| entry == self.entry.as_slice())
    }
}

/// The parent of process `pid`, from `/proc/PID/stat` (`None` if it is gone).
fn parent(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name, in parentheses, may hold spaces and parentheses: the fields follow the last.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Sends `signal` to process `pid`; `false` when it is gone already.
fn signal(pid: i32, signal: rustix::process::Signal) -> bool {
    rustix::process::Pid::from_raw(pid)
        .is_some_and(|pid| rustix::process::kill_process(pid, signal).is_ok())
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

    #[test]
    fn a_tree_made_from_its_mark_value_is_the_same_tree() {
        let tree = ProcessTree::new();
        assert!(!tree.mark_value().is_empty());
        assert_eq!(ProcessTree::with_mark_value(tree.mark_value()), tree);
    }
}
