//! The launcher: starts one child process per rank, relays what they say, and ends the group
//! cleanly when one of them dies.
//!
//! Children are this same executable with the same arguments and the rank variables of
//! [`crate::collective::rank`] set. Their stdout and stderr lines come back as [`LaunchEvent`]s on
//! the caller's thread (reader threads feed a channel), so the caller renders them however it
//! renders the rest of its output.
//!
//! A rank that exits with an error or is killed cannot be waited out: the others would block
//! in their next collective (over TCP they see the broken connection, over NCCL they may hang
//! for good), so the launcher kills them at once and reports the first rank that failed. A
//! rank that exits successfully while others still run is given [`Launch::grace_after_exit`]
//! (when set) before the rest are killed as stuck, which is what a trial needs when one rank
//! stops early at an out-of-memory outcome.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::collective::rank::{RankEnv, Rendezvous};
use crate::{Error, Result};

/// The line a launcher writes on a rank's stdin to ask it to checkpoint and stop.
pub const INTERRUPT_LINE: &str = "interrupt";

/// What the launcher does with each rank's stdin.
#[derive(Debug, Clone)]
pub enum RankInput {
    /// Keeps it open and writes [`INTERRUPT_LINE`] when the interrupt flag is set; ranks stop
    /// when it closes (the launcher is gone).
    Interrupts,
    /// Writes these bytes and closes it (a trial's job description).
    Job(Vec<u8>),
}

/// A group of ranks to start.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The executable (normally the running `autotune`).
    pub program: PathBuf,
    /// Its arguments, the same for every rank.
    pub args: Vec<OsString>,
    /// Ranks to start.
    pub world_size: usize,
    /// Where they meet.
    pub rendezvous: Rendezvous,
    /// What goes to their stdin.
    pub input: RankInput,
    /// How long the others may keep running after one rank exited successfully.
    pub grace_after_exit: Option<Duration>,
    /// How long the group may run at all before every rank is killed (a trial's time limit);
    /// `None` for training, which runs as long as it takes.
    pub deadline: Option<Duration>,
}

/// How one rank ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankExit {
    /// It exited with this code.
    Code(i32),
    /// A signal ended it (the out-of-memory killer's is 9).
    Signal(i32),
    /// The launcher killed it because another rank had failed or it outlived the grace period.
    Stopped,
}

impl RankExit {
    fn of(status: ExitStatus) -> Self {
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            if let Some(signal) = status.signal() {
                return RankExit::Signal(signal);
            }
        }
        RankExit::Code(status.code().unwrap_or(-1))
    }

    /// Whether the rank finished on its own with exit code 0.
    pub fn is_success(self) -> bool {
        self == RankExit::Code(0)
    }
}

impl std::fmt::Display for RankExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RankExit::Code(c) => write!(f, "exited with code {c}"),
            RankExit::Signal(9) => {
                f.write_str("was killed (signal 9: out of host memory, or killed by hand)")
            }
            RankExit::Signal(s) => write!(f, "was killed by signal {s}"),
            RankExit::Stopped => f.write_str("was stopped by the launcher"),
        }
    }
}

/// Something a rank did, in the order the launcher saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchEvent {
    /// The rank's process started.
    Started {
        /// Its rank.
        rank: usize,
        /// Its process id.
        pid: u32,
    },
    /// A line of the rank's stdout (its messages).
    Output {
        /// Its rank.
        rank: usize,
        /// The line, without the newline.
        line: String,
    },
    /// A line of the rank's stderr (warnings, errors).
    Log {
        /// Its rank.
        rank: usize,
        /// The line, without the newline.
        line: String,
    },
    /// The rank's process ended.
    Exited {
        /// Its rank.
        rank: usize,
        /// How.
        exit: RankExit,
    },
}

/// The first rank that failed, with its last words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// The rank.
    pub rank: usize,
    /// How it ended.
    pub exit: RankExit,
    /// Its last non-empty stderr line (its error message, when it printed one).
    pub last_log: Option<String>,
}

impl std::fmt::Display for RankFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} {}", self.rank, self.exit)?;
        if let Some(line) = &self.last_log {
            write!(f, ": {line}")?;
        }
        Ok(())
    }
}

/// How the whole group ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchOutcome {
    /// Each rank's exit, by rank.
    pub exits: Vec<RankExit>,
    /// The first rank that failed, if any did.
    pub failure: Option<RankFailure>,
    /// Whether the group ran into [`Launch::deadline`] and was killed.
    pub timed_out: bool,
}

enum Line {
    Out(usize, String),
    Err(usize, String),
}

/// Starts the ranks and runs until all have ended; `on_event` sees everything they do.
/// Spawning errors are errors; anything a rank does, dying included, is in the outcome.
pub fn run(
    launch: &Launch,
    interrupt: &AtomicBool,
    on_event: &mut dyn FnMut(LaunchEvent),
) -> Result<LaunchOutcome> {
    let (tx, rx) = mpsc::channel::<Line>();
    let started = Instant::now();
    let mut group = spawn_ranks(launch, &tx, on_event)?;
    drop(tx);
    let mut lines_open = true;
    let mut timed_out = false;
    loop {
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(line) => group.relay(line, on_event),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => lines_open = false,
        }
        if interrupt.load(Ordering::SeqCst) {
            group.forward_interrupt();
        }
        group.reap();
        group.stop_the_rest_if_done(launch.grace_after_exit);
        if launch.deadline.is_some_and(|d| started.elapsed() > d) && !group.all_exited() {
            timed_out = true;
            group.stop_all();
        }
        if group.all_exited() && !lines_open {
            break;
        }
    }
    let mut outcome = group.outcome(on_event);
    outcome.timed_out = timed_out;
    Ok(outcome)
}

/// The running ranks and what is known of how they are doing.
struct RankGroup {
    children: Vec<Child>,
    /// Each rank's stdin while it is open and takes interrupts.
    stdins: Vec<Option<ChildStdin>>,
    exits: Vec<Option<RankExit>>,
    /// Each rank's last non-empty stderr line: its last words if it fails.
    last_log: Vec<Option<String>>,
    failure: Option<RankFailure>,
    interrupted: bool,
    first_success: Option<Instant>,
}

/// Starts every rank with its rank variables, forwarding its output lines to `tx`; a rank that
/// cannot be started stops the ones already running.
fn spawn_ranks(
    launch: &Launch,
    tx: &mpsc::Sender<Line>,
    on_event: &mut dyn FnMut(LaunchEvent),
) -> Result<RankGroup> {
    let mut children: Vec<Child> = Vec::with_capacity(launch.world_size);
    let mut stdins: Vec<Option<ChildStdin>> = Vec::with_capacity(launch.world_size);
    for rank in 0..launch.world_size {
        let mut command = Command::new(&launch.program);
        command
            .args(&launch.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        RankEnv {
            rank,
            world_size: launch.world_size,
            rendezvous: launch.rendezvous.clone(),
        }
        .apply(&mut command);
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                stop_all(&mut children);
                return Err(Error::file(
                    "cannot start a data-parallel rank",
                    &launch.program,
                    e,
                ));
            }
        };
        on_event(LaunchEvent::Started {
            rank,
            pid: child.id(),
        });
        if let Some(out) = child.stdout.take() {
            forward_lines(out, tx.clone(), move |l| Line::Out(rank, l));
        }
        if let Some(err) = child.stderr.take() {
            forward_lines(err, tx.clone(), move |l| Line::Err(rank, l));
        }
        let stdin = child.stdin.take();
        match (&launch.input, stdin) {
            (RankInput::Job(bytes), Some(mut pipe)) => {
                // A rank that died at once has closed its stdin; its exit tells the story.
                let _ = pipe.write_all(bytes);
                stdins.push(None);
            }
            (_, stdin) => stdins.push(stdin),
        }
        children.push(child);
    }
    let ranks = children.len();
    Ok(RankGroup {
        children,
        stdins,
        exits: vec![None; ranks],
        last_log: vec![None; ranks],
        failure: None,
        interrupted: false,
        first_success: None,
    })
}

impl RankGroup {
    /// Hands a rank's output line on, keeping its last words.
    fn relay(&mut self, line: Line, on_event: &mut dyn FnMut(LaunchEvent)) {
        match line {
            Line::Out(rank, line) => on_event(LaunchEvent::Output { rank, line }),
            Line::Err(rank, line) => {
                if !line.trim().is_empty() {
                    self.last_log[rank] = Some(line.clone());
                }
                on_event(LaunchEvent::Log { rank, line });
            }
        }
    }

    /// Asks every rank that takes interrupts to checkpoint and stop, once.
    fn forward_interrupt(&mut self) {
        if std::mem::replace(&mut self.interrupted, true) {
            return;
        }
        for pipe in self.stdins.iter_mut().flatten() {
            // A rank that is gone cannot be asked; its exit is reported anyway.
            let _ = writeln!(pipe, "{INTERRUPT_LINE}").and_then(|()| pipe.flush());
        }
    }

    /// Collects the exits of ranks that ended, and names the first failure.
    fn reap(&mut self) {
        let mut newly_failed = Vec::new();
        for (rank, child) in self.children.iter_mut().enumerate() {
            if self.exits[rank].is_some() {
                continue;
            }
            let Ok(Some(status)) = child.try_wait() else {
                continue;
            };
            let exit = RankExit::of(status);
            self.exits[rank] = Some(exit);
            self.stdins[rank] = None;
            if exit.is_success() {
                self.first_success.get_or_insert_with(Instant::now);
            } else {
                newly_failed.push((rank, exit));
            }
        }
        if self.failure.is_none() {
            // A rank killed by a signal is the cause; the others then fail on the broken link.
            newly_failed.sort_by_key(|(rank, exit)| (!matches!(exit, RankExit::Signal(_)), *rank));
            if let Some(&(rank, exit)) = newly_failed.first() {
                self.failure = Some(RankFailure {
                    rank,
                    exit,
                    last_log: None,
                });
            }
        }
    }

    /// Once a rank failed, or the others outlived a finished one by `grace`, stops the rest.
    fn stop_the_rest_if_done(&mut self, grace: Option<Duration>) {
        let outlived = match (self.first_success, grace) {
            (Some(t), Some(grace)) => t.elapsed() > grace,
            _ => false,
        };
        if self.failure.is_none() && !outlived {
            return;
        }
        for (rank, child) in self.children.iter_mut().enumerate() {
            if self.exits[rank].is_none() {
                // Already gone is fine: it is about to be reaped.
                let _ = child.kill();
                let _ = child.wait();
                self.exits[rank] = Some(RankExit::Stopped);
            }
        }
    }

    /// Kills every rank still running (the group's time is up).
    fn stop_all(&mut self) {
        for (rank, child) in self.children.iter_mut().enumerate() {
            if self.exits[rank].is_none() {
                // Already gone is fine: it is about to be reaped.
                let _ = child.kill();
                let _ = child.wait();
                self.exits[rank] = Some(RankExit::Stopped);
            }
        }
    }

    fn all_exited(&self) -> bool {
        self.exits.iter().all(Option::is_some)
    }

    /// How the group ended, each rank's exit announced.
    fn outcome(mut self, on_event: &mut dyn FnMut(LaunchEvent)) -> LaunchOutcome {
        let exits: Vec<RankExit> = self.exits.into_iter().flatten().collect();
        for (rank, exit) in exits.iter().enumerate() {
            on_event(LaunchEvent::Exited { rank, exit: *exit });
        }
        if let Some(f) = &mut self.failure {
            f.last_log = self.last_log[f.rank].take();
        }
        LaunchOutcome {
            exits,
            failure: self.failure,
            timed_out: false,
        }
    }
}

fn forward_lines<R: std::io::Read + Send + 'static>(
    reader: R,
    tx: mpsc::Sender<Line>,
    wrap: impl Fn(String) -> Line + Send + 'static,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else { break };
            if tx.send(wrap(line)).is_err() {
                break;
            }
        }
    });
}

fn stop_all(children: &mut [Child]) {
    for child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A rendezvous for ranks on this host: a free loopback port for TCP.
///
/// The port is found by binding port 0 and releasing it, so another process could take it in
/// between; rank 0 then fails to listen and says so, and a second launch picks another port.
pub fn local_tcp_rendezvous() -> Result<Rendezvous> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| Error::Collective {
        rank: 0,
        problem: format!("cannot find a free loopback port ({e})"),
    })?;
    let addr = listener.local_addr().map_err(|e| Error::Collective {
        rank: 0,
        problem: format!("cannot read the loopback port ({e})"),
    })?;
    Ok(Rendezvous::Tcp(addr))
}

/// The rendezvous for ranks on `device_kind` GPUs: NCCL when this build has it, else TCP
/// (which also runs on GPUs, copying through the host).
pub fn rendezvous_for(cuda: bool) -> Result<Rendezvous> {
    #[cfg(feature = "nccl")]
    if cuda {
        return Ok(Rendezvous::Nccl(crate::collective::nccl::new_unique_id()?));
    }
    let _ = cuda;
    local_tcp_rendezvous()
}

/// Watches stdin of a rank started with [`RankInput::Interrupts`]: [`INTERRUPT_LINE`], or the
/// launcher going away (stdin closes), sets `flag`.
pub fn watch_launcher(flag: std::sync::Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            match line {
                Ok(l) if l.trim() == INTERRUPT_LINE => flag.store(true, Ordering::SeqCst),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        flag.store(true, Ordering::SeqCst);
    });
}
