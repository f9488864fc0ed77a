//! A trial runner's process (`tune --backend exec -- CMD`): started in a process group of its
//! own, fed request lines on stdin, its stdout scanned for reply lines and its stderr kept for
//! its last words; stopped together with every process it started.
//!
//! A process group, because a runner is any program: a Python script that starts data-loader
//! workers, a shell script that starts Python. Killing only the runner would leave them holding
//! the GPU's memory (which the next trial would then lack) and the pipes open. After every
//! trial the group is killed once the runner is done with it, and so is every process marked
//! as the runner's ([`ProcessTree`]: those that left the group with `setsid` too), so nothing
//! of a trial outlives it. What a runner prints is read through bounded lines
//! ([`MAX_LINE_BYTES`]), so a runner that prints without end costs autotune no memory.
//!
//! Requests are written by a thread of their own: a runner that does not read its stdin would
//! otherwise block autotune in the write once the pipe is full, beyond any time limit. The
//! write is then part of the wait for the reply, which the trial's limit bounds.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::tree::ProcessTree;
use super::watchdog::Watchdog;
use crate::trial_protocol::{parse_reply_line, BadReply, RunnerReply, REQUEST_PROTOCOL_VERSION};
use crate::{Error, Result};

/// The longest line kept from a runner's output; the rest of a longer line is dropped.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// The most characters of a runner's last words kept for a crash's reason.
const LAST_WORDS_CHARS: usize = 300;

/// How often a wait for a reply looks whether the runner has exited.
const POLL: Duration = Duration::from_millis(50);

/// How long after its exit a runner's last output may take to arrive through the pipe.
const DRAIN: Duration = Duration::from_millis(500);

/// How long a runner that has answered may take to exit on its own before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(10);

/// The program a trial runner is and its arguments, as given after `--`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerCommand {
    program: String,
    args: Vec<String>,
    /// Variables set (`Some`) or removed (`None`) in the runner's environment.
    env: Vec<(String, Option<String>)>,
}

impl RunnerCommand {
    /// The command `argv` (program first); `None` when it is empty.
    pub fn new(argv: &[String]) -> Option<Self> {
        let (program, args) = argv.split_first()?;
        Some(Self {
            program: program.clone(),
            args: args.to_vec(),
            env: Vec::new(),
        })
    }

    /// The same command with `name` set to `value` in its environment, or removed from it
    /// when `value` is `None`.
    pub fn with_env(mut self, name: &str, value: Option<String>) -> Self {
        self.env.retain(|(n, _)| n != name);
        self.env.push((name.to_string(), value));
        self
    }

    /// What the command's environment holds for `name`, where it sets or removes it
    /// (`Some(None)`: removed); `None` where it leaves the variable as this process has it.
    pub fn env(&self, name: &str) -> Option<Option<&str>> {
        self.env
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_deref())
    }

    /// The command as a person would type it, for messages.
    pub fn display(&self) -> String {
        std::iter::once(&self.program)
            .chain(&self.args)
            .map(|a| {
                if a.is_empty() || a.contains(|c: char| c.is_whitespace() || c == '\'') {
                    format!("'{}'", a.replace('\'', r"'\''"))
                } else {
                    a.clone()
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// The runner that is running now, if any, for an interrupt handler: [`RunningGroup::stop`]
/// kills the runner and everything it started. (The runner's group is not the terminal's, so
/// Ctrl-C reaches only autotune.)
///
/// With a [`Watchdog`], each runner is also held there, so that it is killed when autotune
/// ends by a signal no handler sees (SIGKILL).
#[derive(Debug, Clone, Default)]
pub struct RunningGroup {
    running: Arc<Mutex<Option<(i32, ProcessTree)>>>,
    watchdog: Option<Arc<Watchdog>>,
}

impl RunningGroup {
    /// A group whose runners `watchdog` also holds.
    pub fn watched_by(watchdog: Watchdog) -> Self {
        Self {
            running: Arc::default(),
            watchdog: Some(Arc::new(watchdog)),
        }
    }

    /// Kills the running runner's process group and tree, if a runner is running.
    pub fn stop(&self) {
        let running = self.running.lock().map(|r| r.clone()).unwrap_or_default();
        if let Some((pgid, tree)) = running {
            tree.kill_with_group(pgid);
        }
    }

    fn hold(&self, pgid: i32, tree: &ProcessTree) {
        if let Some(watchdog) = &self.watchdog {
            watchdog.holding(pgid, tree);
        }
        if let Ok(mut running) = self.running.lock() {
            *running = Some((pgid, tree.clone()));
        }
    }

    /// Forgets runner `pgid`, if it is the one held (a newer runner may hold the slot).
    fn release(&self, pgid: i32) {
        if let Some(watchdog) = &self.watchdog {
            watchdog.released(pgid);
        }
        if let Ok(mut running) = self.running.lock() {
            if running.as_ref().is_some_and(|(held, _)| *held == pgid) {
                *running = None;
            }
        }
    }
}

/// What a wait for a reply ended with.
pub(super) enum Waited {
    /// The reply, read and checked.
    Reply(RunnerReply),
    /// A reply that is not valid, and why.
    Invalid(autotune_core::Error),
    /// A reply of another protocol version: the version found.
    OtherVersion(String),
    /// The runner ended without a reply.
    Ended(Ended),
    /// No reply within the limit: the runner and its group were killed.
    TimedOut,
}

/// How a runner that did not reply ended.
pub(super) struct Ended {
    /// Its exit status (`None` if it could not be read).
    pub status: Option<ExitStatus>,
    /// Its last non-empty line on stderr.
    pub last_stderr: String,
    /// Its last non-empty line on stdout that was not a reply.
    pub last_stdout: String,
}

/// What a runner's stdout reader passes on.
enum Stdout {
    /// The lines of one read that may be replies (objects naming `protocol`): together, so
    /// that a reply written twice at once is seen twice before the next request is written.
    Candidates(Vec<String>),
    /// End of the output: the runner exited or closed its stdout.
    Closed,
}

/// A running trial runner.
pub(super) struct RunnerProcess {
    child: Child,
    pid: i32,
    tree: ProcessTree,
    /// Request lines to the writer thread; dropped, the runner's stdin is closed.
    requests: Option<Sender<String>>,
    stdout: Receiver<Stdout>,
    /// Candidate lines received and not yet read.
    pending: VecDeque<String>,
    /// Whether the runner's stdout has ended.
    closed: bool,
    last_stdout: Arc<Mutex<String>>,
    last_stderr: Arc<Mutex<String>>,
    running: RunningGroup,
    /// Whether the process has been reaped.
    reaped: bool,
}

impl RunnerProcess {
    /// Starts `command` in a process group of its own, marked as a tree of its own, with
    /// `AUTOTUNE_PROTOCOL` set to the requests' protocol version; `running` holds it while it
    /// runs.
    pub fn start(command: &RunnerCommand, running: &RunningGroup) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let tree = ProcessTree::new();
        let mut spawn = Command::new(&command.program);
        spawn.args(&command.args);
        for (name, value) in &command.env {
            match value {
                Some(value) => spawn.env(name, value),
                None => spawn.env_remove(name),
            };
        }
        spawn
            .env("AUTOTUNE_PROTOCOL", REQUEST_PROTOCOL_VERSION.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        tree.mark(&mut spawn);
        let mut child = spawn
            .spawn()
            .map_err(|e| Error::file("cannot start the trial runner", &command.program, e))?;
        let pid = i32::try_from(child.id())
            .map_err(|_| Error::internal("the trial runner's pid is out of range"))?;
        running.hold(pid, &tree);
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            tree.kill_with_group(pid);
            let _ = child.wait();
            running.release(pid);
            return Err(Error::internal(
                "the trial runner started without its pipes",
            ));
        };
        let last_stdout = Arc::new(Mutex::new(String::new()));
        let last_stderr = Arc::new(Mutex::new(String::new()));
        read_stderr(stderr, Arc::clone(&last_stderr));
        Ok(Self {
            child,
            pid,
            tree,
            requests: Some(write_requests(stdin)),
            stdout: read_replies(stdout, Arc::clone(&last_stdout)),
            pending: VecDeque::new(),
            closed: false,
            last_stdout,
            last_stderr,
            running: running.clone(),
            reaped: false,
        })
    }

    /// Hands one request line to the writer; with `last`, closes stdin after it (the runner
    /// then sees the end of its input). A runner that does not read shows it in the wait for
    /// its reply, which is bounded; one that is gone, in its end.
    pub fn send(&mut self, line: &str, last: bool) {
        if let Some(requests) = &self.requests {
            // A writer that has stopped (the runner closed its stdin) leaves the reply's wait
            // to tell what the runner did.
            let _ = requests.send(line.to_string());
        }
        if last {
            self.requests = None;
        }
    }

    /// Whether the runner is still running (it may serve the next trial).
    pub fn alive(&self) -> bool {
        !self.reaped && !self.exited()
    }

    /// Waits up to `limit` for the reply to request `request_id`, just sent; lines of the
    /// runner's own output (anything that is not a reply) and replies to other requests are
    /// skipped.
    pub fn wait_reply(&mut self, limit: Duration, request_id: u64) -> Waited {
        let deadline = Instant::now() + limit;
        let mut exited_at: Option<Instant> = None;
        loop {
            while let Some(line) = self.pending.pop_front() {
                match parse_reply_line(&line, request_id) {
                    Some(Ok(reply)) => return Waited::Reply(reply),
                    Some(Err(BadReply::Invalid(e))) => return Waited::Invalid(e),
                    Some(Err(BadReply::Version(found))) => return Waited::OtherVersion(found),
                    Some(Err(BadReply::AnotherRequest(id))) => {
                        tracing::warn!(id, request_id, "a reply to another request, skipped");
                    }
                    None => {}
                }
            }
            let now = Instant::now();
            if now >= deadline {
                self.kill();
                return Waited::TimedOut;
            }
            if self.closed {
                // Nothing more can arrive: wait for the exit itself.
                if self.exited() {
                    return Waited::Ended(self.ended());
                }
                std::thread::sleep(POLL.min(deadline - now));
                continue;
            }
            match self.stdout.recv_timeout(POLL.min(deadline - now)) {
                Ok(Stdout::Candidates(lines)) => self.pending.extend(lines),
                Ok(Stdout::Closed) | Err(RecvTimeoutError::Disconnected) => self.closed = true,
                Err(RecvTimeoutError::Timeout) => {
                    // A runner that exited may have left a process holding its stdout open:
                    // what it wrote arrives within the drain time, or not at all.
                    if self.exited() {
                        match exited_at {
                            None => exited_at = Some(now),
                            Some(at) if now - at > DRAIN => return Waited::Ended(self.ended()),
                            Some(_) => {}
                        }
                    }
                }
            }
        }
    }

    /// How many replies the runner wrote that no request is waiting for (a reply written
    /// twice): they are dropped. A runner that wrote any is not trusted with the next trial,
    /// since a reply of protocol 1 names no request and a late one would be taken for it.
    pub fn unasked_replies(&mut self) -> usize {
        while let Ok(message) = self.stdout.try_recv() {
            match message {
                Stdout::Candidates(lines) => self.pending.extend(lines),
                Stdout::Closed => self.closed = true,
            }
        }
        self.pending
            .drain(..)
            .filter(|line| parse_reply_line(line, 0).is_some())
            .count()
    }

    /// Ends a runner that has answered and will not serve again: closes its input, gives it
    /// [`EXIT_GRACE`] to exit, then kills whatever of its group is left.
    pub fn finish(mut self) {
        self.requests = None;
        let deadline = Instant::now() + EXIT_GRACE;
        while !self.exited() && Instant::now() < deadline {
            std::thread::sleep(POLL);
        }
        self.kill();
    }

    /// Kills the runner's group and tree, and reaps the runner.
    pub fn kill(&mut self) {
        if self.reaped {
            return;
        }
        // Stopped before its input ends: a runner that exited at the end of its input would
        // leave its children to be found by their mark alone.
        self.tree.kill_with_group(self.pid);
        // The runner may have left its group and cleared its environment; it goes too.
        let _ = self.child.kill();
        self.requests = None;
        let _ = self.child.wait();
        self.reaped = true;
        self.running.release(self.pid);
    }

    /// Whether the runner has exited; it stays unreaped, so that its process group id cannot
    /// be taken by another process before the group is killed.
    fn exited(&self) -> bool {
        let Some(pid) = rustix::process::Pid::from_raw(self.pid) else {
            return true;
        };
        let options = rustix::process::WaitIdOptions::EXITED
            | rustix::process::WaitIdOptions::NOWAIT
            | rustix::process::WaitIdOptions::NOHANG;
        // An error means there is no such child to wait for: it is gone.
        rustix::process::waitid(rustix::process::WaitId::Pid(pid), options)
            .map_or(true, |status| status.is_some())
    }

    /// How a runner that exited without a reply ended (its group is killed and it is reaped).
    fn ended(&mut self) -> Ended {
        self.requests = None;
        self.tree.kill_with_group(self.pid);
        let status = self.child.wait();
        self.reaped = true;
        self.running.release(self.pid);
        let last = |words: &Arc<Mutex<String>>| words.lock().map(|s| s.clone()).unwrap_or_default();
        Ended {
            status: status.ok(),
            last_stderr: last(&self.last_stderr),
            last_stdout: last(&self.last_stdout),
        }
    }
}

impl Drop for RunnerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A thread that writes each request line it is handed to the runner's `stdin`, and closes it
/// when the sender is dropped or a write fails (the runner closed it, or was killed).
fn write_requests(mut stdin: ChildStdin) -> Sender<String> {
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in rx {
            let written = stdin
                .write_all(line.as_bytes())
                .and_then(|()| stdin.write_all(b"\n"))
                .and_then(|()| stdin.flush());
            if written.is_err() {
                break;
            }
        }
    });
    tx
}

/// A thread that passes on the lines of the runner's `stdout` that may be replies, a read's
/// worth at a time, and keeps the last other line in `last`.
fn read_replies(stdout: impl Read + Send + 'static, last: Arc<Mutex<String>>) -> Receiver<Stdout> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut candidates = Vec::new();
        for_each_line(stdout, |line| match line {
            Some(line) => {
                let text = String::from_utf8_lossy(line);
                let text = text.trim();
                if text.starts_with('{') && text.contains("\"protocol\"") {
                    candidates.push(text.to_string());
                } else {
                    keep_last(&last, text);
                }
            }
            None if !candidates.is_empty() => {
                // The reader ends with the process; a closed receiver is not an error.
                let _ = tx.send(Stdout::Candidates(std::mem::take(&mut candidates)));
            }
            None => {}
        });
        let _ = tx.send(Stdout::Closed);
    });
    rx
}

/// A thread that logs the runner's `stderr` and keeps its last line in `last`.
fn read_stderr(stderr: impl Read + Send + 'static, last: Arc<Mutex<String>>) {
    std::thread::spawn(move || {
        for_each_line(stderr, |line| {
            if let Some(line) = line {
                let text = String::from_utf8_lossy(line);
                tracing::debug!("runner: {}", text.trim_end());
                keep_last(&last, text.trim());
            }
        });
    });
}

/// `text`, if not empty, as the last words in `sink`, cut to [`LAST_WORDS_CHARS`].
fn keep_last(sink: &Mutex<String>, text: &str) {
    if text.is_empty() {
        return;
    }
    if let Ok(mut last) = sink.lock() {
        // A reason is shown to people and written into plans: no control characters.
        *last = text
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .take(LAST_WORDS_CHARS)
            .collect();
    }
}

/// Calls `f` with each line `reader` yields (without its newline), up to [`MAX_LINE_BYTES`]
/// of each, and with `None` after the lines each read completed; stops at the end of the
/// input or at an error reading it.
fn for_each_line(mut reader: impl Read, mut f: impl FnMut(Option<&[u8]>)) {
    let mut line = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let mut rest = &buf[..n];
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            take_within(&mut line, &rest[..end]);
            f(Some(&line));
            line.clear();
            rest = &rest[end + 1..];
        }
        take_within(&mut line, rest);
        f(None);
    }
    if !line.is_empty() {
        f(Some(&line));
        f(None);
    }
}

/// Appends what of `bytes` fits within [`MAX_LINE_BYTES`] to `line`.
fn take_within(line: &mut Vec<u8>, bytes: &[u8]) {
    let room = MAX_LINE_BYTES.saturating_sub(line.len());
    line.extend_from_slice(&bytes[..bytes.len().min(room)]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_split_and_cut_at_the_bound() {
        let long = vec![b'x'; MAX_LINE_BYTES + 10];
        let mut input = b"one\n\ntwo".to_vec();
        input.push(b'\n');
        input.extend_from_slice(&long);
        input.extend_from_slice(b"\nlast");
        let mut lines = Vec::new();
        for_each_line(&input[..], |l| lines.extend(l.map(<[u8]>::to_vec)));
        assert_eq!(lines.len(), 5);
        assert_eq!(lines[0], b"one");
        assert_eq!(lines[1], b"");
        assert_eq!(lines[2], b"two");
        assert_eq!(lines[3].len(), MAX_LINE_BYTES);
        assert_eq!(lines[4], b"last");
    }

    #[test]
    fn a_command_is_shown_as_typed() {
        let argv: Vec<String> = ["python3", "run.py", "--name", "a b", "it's", ""]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let command = RunnerCommand::new(&argv).unwrap();
        assert_eq!(
            command.display(),
            r#"python3 run.py --name 'a b' 'it'\''s' ''"#
        );
        assert!(RunnerCommand::new(&[]).is_none());
    }
}
