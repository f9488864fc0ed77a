//! The directories a run owns: a checkpoint directory (`train --checkpoint-dir`), and the run
//! directory of `run` (its plan and its checkpoints). One run owns a directory at a time, and a
//! directory that holds another run is refused unless it is resumed or overwritten, so that two
//! runs never mix in one.

use std::path::{Path, PathBuf};

use super::observer::{Notice, SessionObserver};
use crate::plan::schema::Plan;
use crate::train::checkpoint_dir::{self, DirLock};
use crate::{Error, Result};

/// Takes the checkpoint directory `dir` for a run: its lock (held until the returned value is
/// dropped), its stale temporaries swept, and, unless `resume`, its old checkpoints refused,
/// or removed with `overwrite`.
pub fn claim_checkpoint_dir(
    dir: Option<&Path>,
    resume: bool,
    overwrite: bool,
    observer: &dyn SessionObserver,
) -> Result<Option<DirLock>> {
    let Some(dir) = dir else {
        return Ok(None);
    };
    let lock = checkpoint_dir::lock(dir)?;
    let swept = checkpoint_dir::sweep_temporaries(dir)?;
    if swept > 0 {
        observer.notice(Notice::SweptTemporaries {
            count: swept,
            dir: dir.to_path_buf(),
        });
    }
    if !resume && checkpoint_dir::holds_checkpoints(dir)? {
        if !overwrite {
            let newest = checkpoint_dir::checkpoints(dir)?
                .last()
                .map(|(step, _)| format!(" (up to step {step})"))
                .unwrap_or_default();
            return Err(Error::Usage(format!(
                "`{}` already holds checkpoints of a run{newest}; pass --resume to continue it, --overwrite to start over and remove them, or use another directory",
                dir.display()
            )));
        }
        checkpoint_dir::clear(dir)?;
        observer.notice(Notice::Overwrote {
            dir: dir.to_path_buf(),
        });
    }
    Ok(Some(lock))
}

/// `run`'s directory: `plan.json` and `checkpoints/`, locked while the run lasts.
pub struct RunDir {
    root: PathBuf,
    _lock: DirLock,
}

impl RunDir {
    /// Creates and locks `root` before anything else runs: a location that cannot be written
    /// fails now, not after the search.
    pub fn claim(root: &Path) -> Result<Self> {
        Ok(Self {
            _lock: checkpoint_dir::lock(root)?,
            root: root.to_path_buf(),
        })
    }

    /// Where the run's plan is written.
    pub fn plan_path(&self) -> PathBuf {
        self.root.join("plan.json")
    }

    /// Where the run's checkpoints go.
    pub fn checkpoints(&self) -> PathBuf {
        self.root.join("checkpoints")
    }

    /// Whether a run already checkpointed here.
    pub fn has_checkpoints(&self) -> Result<bool> {
        checkpoint_dir::holds_checkpoints(&self.checkpoints())
    }

    /// The plan of the run to continue here (`run --resume`).
    pub fn resumed_plan(&self) -> Result<Plan> {
        if !self.plan_path().exists() {
            return Err(Error::Usage(format!(
                "`run --resume`: `{}` holds no plan.json, so there is no run to continue; drop --resume to start one",
                self.root.display()
            )));
        }
        Ok(Plan::load(&self.plan_path())?)
    }

    /// Refuses a directory that holds a run (a plan or checkpoints) unless `overwrite`.
    pub fn check_fresh(&self, overwrite: bool) -> Result<()> {
        let holds_run = self.plan_path().exists() || self.has_checkpoints()?;
        if holds_run && !overwrite {
            return Err(Error::Usage(format!(
                "`{}` already holds a run (plan.json, checkpoints); pass --resume to continue it, --overwrite to start over and replace it, or use another --run-dir",
                self.root.display()
            )));
        }
        Ok(())
    }
}
