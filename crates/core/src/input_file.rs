//! One way to open every file autotune reads: only a regular file, opened without waiting, and
//! read only up to a bound its kind allows.
//!
//! A path may name anything: a FIFO with no writer blocks `open` forever, `/dev/zero` or
//! `/dev/urandom` never end, a directory reads as an error far from its cause. So an input is
//! opened non-blocking (a FIFO opens at once instead of waiting for a writer), checked to be a
//! regular file through the handle just opened (no window for a swap between check and open),
//! and a whole-file read stops past its bound instead of exhausting memory. The errors are
//! `std::io::Error`s that say what the path is and what to give instead; callers wrap them
//! with the file's name and what it was read as.

use std::fs::File;
use std::io::Read;
use std::path::Path;

/// The most a JSON document (a spec, a `config.json`, a plan, a profile, a checkpoint's state
/// or manifest) may hold: far above any real one, small enough to read whole.
pub const DOCUMENT_LIMIT: u64 = 64 << 20;

/// The most a `tokenizer.json` may hold: real ones are tens of megabytes.
pub const TOKENIZER_LIMIT: u64 = 512 << 20;

/// No bound but the file's own length: for training data and logs, which grow with the work
/// and are read whole by design.
pub const WHOLE: u64 = u64::MAX;

/// Opens `path` for reading if it is a regular file (links followed). Never blocks: a FIFO
/// or a device is refused, not waited on or read.
pub fn open(path: &Path) -> std::io::Result<File> {
    use rustix::fs::{Mode, OFlags};
    // Non-blocking so that opening a FIFO with no writer returns at once; for a regular file
    // the flag changes nothing.
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC;
    let file = File::from(rustix::fs::open(path, flags, Mode::empty())?);
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        return Ok(file);
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!(
            "it is {}, not a regular file; autotune reads its inputs only from regular files: \
             give the file itself",
            describe(kind)
        ),
    ))
}

/// Reads all of `path`, a regular file of at most `limit` bytes.
pub fn read(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let file = open(path)?;
    let len = file.metadata()?.len();
    let too_long = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("it is over {limit} bytes, more than a file of its kind holds: is it the right file?"),
        )
    };
    if len > limit {
        return Err(too_long());
    }
    let mut bytes = Vec::with_capacity(len as usize);
    // One byte past the bound tells a file that grew since its length was read.
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_long());
    }
    Ok(bytes)
}

/// Reads all of `path` as UTF-8 text, a regular file of at most `limit` bytes.
pub fn read_to_string(path: &Path, limit: u64) -> std::io::Result<String> {
    String::from_utf8(read(path, limit)?)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error()))
}

/// What a file that is not a regular one is, in words.
fn describe(kind: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO (a named pipe)"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "a special file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(result: std::io::Result<Vec<u8>>) -> String {
        result.expect_err("refused").to_string()
    }

    #[test]
    fn only_regular_files_are_read_and_never_past_their_bound() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("spec.json");
        std::fs::write(&file, b"{}").unwrap();
        assert_eq!(read(&file, 2).unwrap(), b"{}");
        assert!(problem(read(&file, 1)).contains("over 1 bytes"));
        assert!(problem(read(Path::new("/dev/zero"), 10)).contains("a character device"));
        assert!(problem(read(dir.path(), 10)).contains("a directory"));
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        // Returns at once although no process writes the FIFO.
        assert!(problem(read(&fifo, 10)).contains("a FIFO"));
        assert!(read(&dir.path().join("missing"), 10).is_err());
        std::fs::write(&file, [0xff, 0xfe]).unwrap();
        assert!(read_to_string(&file, 10).is_err(), "not UTF-8");
    }
}
