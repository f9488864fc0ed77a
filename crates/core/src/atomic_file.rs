//! Atomic file writes: nothing that autotune writes is ever seen half-written.
//!
//! The bytes go to a temporary sibling file (named with the process id, so two processes never
//! share one), which is synced and then renamed over the target; a rename within a directory
//! is atomic, so readers see the old file or the new one.

use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` atomically, creating the parent directory if needed.
pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_with(path, |out| out.write_all(bytes))
}

/// Writes what `fill` writes to `path` atomically, creating the parent directory if needed:
/// for files too large to assemble in memory first.
pub fn write_with(
    path: &Path,
    fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file")
    })?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = (|| {
        let file = std::fs::File::create(&tmp)?;
        let mut out = std::io::BufWriter::new(&file);
        fill(&mut out)?;
        out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        // Best effort: the error that matters is the write's, not the clean-up's.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Checks that [`write()`] could write `path` now: its directory exists or can be created, a
/// file can be created in it, and `path` is not a directory. Run before long work whose result
/// goes there, so that a bad location fails first, not after the work.
pub fn check_writable(path: &Path) -> std::io::Result<()> {
    if path.is_dir() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::IsADirectory,
            "it is a directory; name a file",
        ));
    }
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file")
    })?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(format!(
        ".{}.{}.writable",
        name.to_string_lossy(),
        std::process::id()
    ));
    std::fs::File::create(&probe)?;
    std::fs::remove_file(&probe)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_location_that_cannot_be_written_is_found_before_writing() {
        let dir = tempfile::tempdir().unwrap();
        super::check_writable(&dir.path().join("new").join("plan.json")).unwrap();
        assert!(super::check_writable(dir.path()).is_err(), "a directory");
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(
            super::check_writable(&file.join("plan.json")).is_err(),
            "under a file"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path().join("new")).unwrap().collect();
        assert!(names.is_empty(), "the check leaves nothing behind");
    }

    #[test]
    fn replaces_the_file_and_leaves_no_temporary_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("plan.json");
        super::write(&path, b"one").unwrap();
        super::write(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("plan.json")]);
    }
}
