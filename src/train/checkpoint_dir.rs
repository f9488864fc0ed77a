//! The checkpoint directory as a whole: who may write it (a lock), what it holds (the
//! `step-NNNNNN` checkpoints and `latest`), and keeping it tidy (temporaries left by a run that
//! died, retention of the newest checkpoints).
//!
//! One run owns a directory at a time: [`lock`] takes an advisory lock on `DIR/.lock` that the
//! operating system releases when the process ends, however it ends, so a second run on the
//! same directory is refused while the first is alive and never blocked by a stale lock.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The file whose lock a run holds.
pub const LOCK_FILE: &str = ".lock";

/// The pointer to the newest checkpoint.
pub const LATEST: &str = "latest";

/// A held lock on a checkpoint directory, released when dropped or when the process ends.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

/// Takes `dir`'s lock (creating `dir`), or says which process holds it.
pub fn lock(dir: &Path) -> Result<DirLock> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::file("cannot create checkpoint directory", dir, e))?;
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| Error::file("cannot open the lock file", &path, e))?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            let holder = holder.trim();
            let by = if holder.is_empty() {
                String::new()
            } else {
                format!(" ({holder})")
            };
            return Err(Error::invalid(
                "checkpoint directory",
                dir.display().to_string(),
                format!(
                    "is in use by another autotune run{by}; wait for it to end, or use another directory"
                ),
            ));
        }
        Err(e) => return Err(Error::file("cannot lock", &path, std::io::Error::from(e))),
    }
    // Who holds it, for the message a second run gets; the lock is what counts.
    let _ = file
        .set_len(0)
        .and_then(|()| writeln!(file, "pid {}", std::process::id()));
    Ok(DirLock { _file: file })
}

/// Whether `name` is a checkpoint's directory name, `step-` and digits only.
pub fn is_checkpoint_name(name: &str) -> bool {
    name.strip_prefix("step-")
        .is_some_and(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
}

/// The checkpoints in `dir`, oldest (lowest step) first.
pub fn checkpoints(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::file("cannot list checkpoint directory", dir, e)),
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !is_checkpoint_name(&name) || !entry.path().is_dir() {
            continue;
        }
        if let Ok(step) = name["step-".len()..].parse::<u64>() {
            found.push((step, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// Whether `dir` holds a checkpoint or a `latest` pointer.
pub fn holds_checkpoints(dir: &Path) -> Result<bool> {
    Ok(dir.join(LATEST).exists() || !checkpoints(dir)?.is_empty())
}

/// Removes every checkpoint and `latest` from `dir` (a run started over with `--overwrite`).
pub fn clear(dir: &Path) -> Result<()> {
    let latest = dir.join(LATEST);
    if latest.exists() {
        std::fs::remove_file(&latest).map_err(|e| Error::file("cannot remove", &latest, e))?;
    }
    for (_, path) in checkpoints(dir)? {
        std::fs::remove_dir_all(&path).map_err(|e| Error::file("cannot remove", &path, e))?;
    }
    Ok(())
}

/// Removes the temporaries a save left when its process died (`.step-*.tmp-*` directories and
/// `.latest.*.tmp` files); only the lock holder may, since a live save writes them. Returns how
/// many it removed.
pub fn sweep_temporaries(dir: &Path) -> Result<usize> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(0);
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        let result = if name.starts_with(".step-") && name.contains(".tmp-") && path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else if name.starts_with(&format!(".{LATEST}.")) && name.ends_with(".tmp") {
            std::fs::remove_file(&path)
        } else {
            continue;
        };
        result.map_err(|e| Error::file("cannot remove a stale temporary", &path, e))?;
        removed += 1;
    }
    Ok(removed)
}

/// Keeps the newest `keep_last` checkpoints of `dir` and `current` (the one `latest` names),
/// removing the older ones.
pub fn prune(dir: &Path, keep_last: usize, current: &Path) -> Result<()> {
    let all = checkpoints(dir)?;
    let excess = all.len().saturating_sub(keep_last.max(1));
    for (_, path) in all.into_iter().take(excess) {
        if path == current {
            continue;
        }
        std::fs::remove_dir_all(&path)
            .map_err(|e| Error::file("cannot remove an old checkpoint", &path, e))?;
    }
    Ok(())
}

/// The newest checkpoint of `dir` other than `except` whose manifest verifies.
pub fn newest_intact(dir: &Path, except: &Path) -> Option<PathBuf> {
    let all = checkpoints(dir).ok()?;
    all.into_iter()
        .rev()
        .map(|(_, path)| path)
        .find(|path| path != except && super::checkpoint::manifest::verify(path).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_one_directory_is_refused_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let first = lock(dir.path()).unwrap();
        let err = lock(dir.path()).unwrap_err().to_string();
        assert!(err.contains("in use by another autotune run"), "{err}");
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(first);
        lock(dir.path()).unwrap();
    }

    #[test]
    fn retention_keeps_the_newest_and_the_current_and_temporaries_are_swept() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for step in [5, 10, 15, 20] {
            std::fs::create_dir(d.join(format!("step-{step:06}"))).unwrap();
        }
        std::fs::create_dir(d.join(".step-000025.tmp-999")).unwrap();
        std::fs::write(d.join(".latest.999.tmp"), b"x").unwrap();
        std::fs::create_dir(d.join("step-x")).unwrap();
        assert_eq!(sweep_temporaries(d).unwrap(), 2);
        prune(d, 2, &d.join("step-000005")).unwrap();
        let steps: Vec<u64> = checkpoints(d)
            .unwrap()
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(steps, vec![5, 15, 20]);
        clear(d).unwrap();
        assert!(!holds_checkpoints(d).unwrap());
        assert!(d.join("step-x").exists(), "only checkpoints are cleared");
    }
}
