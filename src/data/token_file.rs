//! A file of token ids, memory-mapped a window at a time: a batch maps each sequence's few
//! pages, copies its ids and unmaps them, so a corpus of any size costs the process only the
//! window being read, never a copy of the file.
//!
//! Why not one mapping of the whole file: the kernel maps whole page-cache folios around every
//! touched byte (up to 2 MiB each, measured: about 0.7 MB per 130-token window of a 200 MB
//! file), and random windows then make the mapping's resident share grow toward the whole file
//! within a few hundred steps, `MADV_RANDOM` or not (nanoGPT recreates its `np.memmap` every
//! batch for the same reason). A mapping only as large as its window can hold no more.
//!
//! Opening checks the whole file once (its length against the token width, every id against
//! the vocabulary) by reading it in blocks, which leaves the file in the page cache and none of
//! it in the process's memory.

use std::io::Read;
use std::path::{Path, PathBuf};

use memmap2::MmapOptions;

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
    /// Maps `path` as ids of `width` bytes (1, 2 or 4), checking that it holds at least
    /// `min_tokens` of them, a whole number, and every one below `vocab`.
    pub fn open(path: &Path, width: usize, min_tokens: usize, vocab: usize) -> Result<Self> {
        let data_err = |problem: String| Error::Data {
            source_name: path.display().to_string(),
            problem,
        };
        let file = std::fs::File::open(path)
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

    /// Appends tokens `start .. start + count` to `out`, read through a mapping of just
    /// their bytes.
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
        if count == 0 {
            return Ok(());
        }
        // SAFETY: the mapping is read-only, private to this process and dropped before this
        // returns. If another process truncated the file meanwhile, reading a page past its
        // new end would fault (SIGBUS): training data is not edited under a run, as with any
        // memory-mapped corpus.
        #[allow(unsafe_code)]
        let window = unsafe {
            MmapOptions::new()
                .offset((start * self.width) as u64)
                .len((end - start) * self.width)
                .map(&self.file)
        }
        .map_err(|e| Error::file("cannot map training data", &self.path, e))?;
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
