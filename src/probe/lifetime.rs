//! A trial process (`probe-one`, `probe-serve`) ends with the autotune that started it.
//!
//! Killed by a signal it does not handle (a `timeout`, a job scheduler's SIGTERM, SIGKILL), a
//! searching autotune could leave its worker running: the worker only notices when its current
//! trial ends and the reply finds no reader, and until then it holds the GPU memory of that
//! trial. The next autotune on the same GPU then finds that memory taken, and its trials fail
//! as if the model did not fit. So the parent names itself in [`PARENT_VARIABLE`], and the
//! trial process asks the kernel to kill it when that parent ends (Linux; elsewhere it ends at
//! its next reply, as before).

use std::process::Command;

use crate::{Error, Result};

/// The environment variable holding the process id of the autotune that started a trial
/// process.
pub const PARENT_VARIABLE: &str = "AUTOTUNE_TRIAL_PARENT";

/// Names this process as the parent of the trial process `command` will start.
pub(crate) fn name_this_process_as_parent(command: &mut Command) {
    command.env(PARENT_VARIABLE, std::process::id().to_string());
}

/// In a trial process, before it starts any thread: ends this process when the parent named in
/// [`PARENT_VARIABLE`] ends; an error if that parent has already ended (this process then has
/// no one to answer). Without the variable (a trial process started by hand) nothing is tied.
/// The variable is removed, so that the processes this one starts (data-parallel ranks) are
/// not measured against a parent that is not theirs.
pub fn end_with_parent() -> Result<()> {
    let Ok(named) = std::env::var(PARENT_VARIABLE) else {
        return Ok(());
    };
    std::env::remove_var(PARENT_VARIABLE);
    let parent: i32 = named.trim().parse().map_err(|_| {
        Error::invalid(
            PARENT_VARIABLE,
            "value",
            "must be the process id of the autotune that starts the trial",
        )
    })?;
    tie_to_parent(parent)
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn tie_to_parent(parent: i32) -> Result<()> {
    use rustix::process::{getppid, set_parent_process_death_signal, Pid, Signal};
    set_parent_process_death_signal(Some(Signal::KILL))
        .map_err(|e| Error::internal(format!("cannot tie the trial to its parent: {e}")))?;
    // Asked after the death signal is set, so that a parent ending in between is seen here.
    if Pid::as_raw(getppid()) != parent {
        return Err(Error::Usage(format!(
            "the autotune that started this trial (process {parent}) has ended; nothing is \
             left to answer"
        )));
    }
    Ok(())
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn tie_to_parent(_parent: i32) -> Result<()> {
    Ok(())
}
