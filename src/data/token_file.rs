//! A file of token ids, read a window at a time: a batch reads each sequence's few bytes at
//! their offset, so a corpus of any size costs the process only the window being read, never a
//! copy of the file (the rest stays in the page cache, which the kernel may drop).
//!
//! Why positioned reads and not a memory map: a file truncated under a mapping (a copy
//! restarted, a disk cleaned up) kills the process with SIGBUS at the next page it touches,
//! with no message and no checkpoint; a read past the new end returns short instead, which
//! becomes [`Error::DataChanged`], and the loop saves a checkpoint before it stops. (A mapping
//! of the whole file is worse still: the kernel maps whole page-cache folios around every
//! touched byte, and random windows make its resident share grow toward the whole file.)
//!
//! Opening checks the whole file once (its length against the token width, every id against
//! the vocabulary) by reading it in blocks, which leaves the file in the page cache and none of
//! it in the process's memory.

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Bytes read at a time while checking a file.
const CHECK_BLOCK: usize = 1 << 20;

/// A file of little-endian token ids, `width` bytes each (1: bytes of text).
pub struct TokenFile {
    file: std::fs::File,
    tokens: usize,
    width: usize,
    path: PathBuf,
}

impl TokenFile {
    /// Opens `path` as ids of `width` bytes (1, 2 or 4), checking that it holds at least
    /// `min_tokens` of them, a whole number, and every one below `vocab`.
    pub fn open(path: &Path, width: usize, min_tokens: usize, vocab: usize) -> Result<Self> {
        let data_err = |problem: String| Error::Data {
            source_name: path.display().to_string(),
            problem,
        };
        let file = crate::input_file::open(path)
            .map_err(|e| Error::file("cannot read training data", path, e))?;
        let bytes = file
            .metadata()
            .map_err(|e| Error::file("cannot read training data", path, e))?
            .len();
        if bytes % width as u64 != 0 {
            return Err(data_err(format!(
                "size {bytes} is not a multiple of {width} bytes per token; is the token width right?"
            )));
        }
        let tokens = bytes / width as u64;
        if tokens < min_tokens as u64 {
            return Err(data_err(format!(
                "holds {tokens} tokens; one sequence needs seq_len + 1 = {min_tokens}"
            )));
        }
        if let Some(max) = largest_id(&file, width)
            .map_err(|e| Error::file("cannot read training data", path, e))?
        {
            if max as usize >= vocab {
                return Err(data_err(format!(
                    "contains token id {max}, outside the model's vocab_size {vocab}; check the token width or vocab_size"
                )));
            }
        }
        Ok(Self {
            file,
            tokens: tokens as usize,
            width,
            path: path.to_path_buf(),
        })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens
    }

    /// Whether the file holds no tokens (never true once opened).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends tokens `start .. start + count` to `out`, reading just their bytes. A file cut
    /// short since it was opened is [`Error::DataChanged`].
    pub fn extend(&self, out: &mut Vec<u32>, start: usize, count: usize) -> Result<()> {
        let end = start.checked_add(count).filter(|&end| end <= self.tokens);
        let Some(end) = end else {
            return Err(Error::internal(format!(
                "tokens {start}..{} asked of `{}`, which holds {}",
                start.saturating_add(count),
                self.path.display(),
                self.tokens
            )));
        };
        let mut window = vec![0u8; count * self.width];
        match self
            .file
            .read_exact_at(&mut window, (start * self.width) as u64)
        {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(Error::DataChanged {
                    path: self.path.clone(),
                    problem: format!(
                        "it held {} tokens when the run started and now ends before token {end}",
                        self.tokens
                    ),
                    checkpoint: None,
                })
            }
            Err(e) => return Err(Error::file("cannot read training data", &self.path, e)),
        }
        out.extend(
            window
                .chunks_exact(self.width)
                .map(|c| decode(c, self.width)),
        );
        Ok(())
    }
}

fn decode(bytes: &[u8], width: usize) -> u32 {
    match width {
        1 => u32::from(bytes[0]),
        2 => u32::from(u16::from_le_bytes([bytes[0], bytes[1]])),
        _ => u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
    }
}

/// The largest id in `file`, read block by block (`None` for an empty file).
fn largest_id(mut file: &std::fs::File, width: usize) -> std::io::Result<Option<u32>> {
    let mut block = vec![0u8; CHECK_BLOCK];
    let mut largest: Option<u32> = None;
    let mut filled = 0;
    loop {
        let read = file.read(&mut block[filled..])?;
        filled += read;
        // Decode whole tokens; a partial one waits for the next read.
        let whole = filled / width * width;
        if let Some(max) = block[..whole]
            .chunks_exact(width)
            .map(|c| decode(c, width))
            .max()
        {
            largest = Some(largest.map_or(max, |l| l.max(max)));
        }
        block.copy_within(whole..filled, 0);
        filled -= whole;
        if read == 0 {
            return Ok(largest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn problem(result: Result<TokenFile>) -> String {
        match result {
            Err(Error::Data { problem, .. }) => problem,
            Err(other) => panic!("expected a data error, got {other}"),
            Ok(_) => panic!("expected a data error"),
        }
    }

    #[test]
    fn ids_of_every_width_read_back_little_endian() {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<u32> = (0..300).map(|i| (i * 7919) % 65_000).collect();
        let u16s: Vec<u8> = ids.iter().flat_map(|&i| (i as u16).to_le_bytes()).collect();
        let u32s: Vec<u8> = ids
            .iter()
            .flat_map(|&i| (i + 70_000).to_le_bytes())
            .collect();
        let text: Vec<u8> = ids.iter().map(|&i| (i % 256) as u8).collect();
        for (width, bytes, want) in [
            (2, u16s, ids.clone()),
            (4, u32s, ids.iter().map(|i| i + 70_000).collect::<Vec<_>>()),
            (1, text, ids.iter().map(|i| i % 256).collect::<Vec<_>>()),
        ] {
            let path = file(dir.path(), &format!("w{width}"), &bytes);
            let tokens = TokenFile::open(&path, width, 10, 1 << 20).unwrap();
            assert_eq!(tokens.len(), 300);
            let mut got = vec![7];
            tokens.extend(&mut got, 5, 20).unwrap();
            assert_eq!(got[0], 7, "appends");
            assert_eq!(&got[1..], &want[5..25], "width {width}");
            assert!(tokens.extend(&mut got, 290, 11).is_err(), "past the end");
        }
    }

    #[test]
    fn a_file_cut_short_after_opening_is_a_data_change_not_a_fault() {
        let dir = tempfile::tempdir().unwrap();
        let path = file(dir.path(), "cut.bin", &[3u8; 200]);
        let tokens = TokenFile::open(&path, 2, 10, 1000).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(40)
            .unwrap();
        let mut got = Vec::new();
        tokens.extend(&mut got, 0, 20).unwrap();
        match tokens.extend(&mut got, 50, 20) {
            Err(Error::DataChanged { path: named, .. }) => assert_eq!(named, path),
            other => panic!("expected the data changed, got {:?}", other.err()),
        }
    }

    #[test]
    fn a_file_the_model_cannot_read_is_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let odd = file(dir.path(), "odd.bin", &[1, 0, 2]);
        assert!(problem(TokenFile::open(&odd, 2, 1, 100)).contains("not a multiple of 2"));
        let short = file(dir.path(), "short.bin", &[1, 0, 2, 0]);
        assert!(problem(TokenFile::open(&short, 2, 3, 100)).contains("holds 2 tokens"));
        // An id past the vocabulary at the very end of a file longer than one check block.
        let mut bytes = vec![0u8; 3 * CHECK_BLOCK];
        bytes.extend_from_slice(&500u16.to_le_bytes());
        let big = file(dir.path(), "big.bin", &bytes);
        let why = problem(TokenFile::open(&big, 2, 2, 500));
        assert!(why.contains("token id 500"), "{why}");
        assert!(TokenFile::open(&big, 2, 2, 501).is_ok());
    }
}
