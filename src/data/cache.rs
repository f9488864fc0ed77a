//! The token cache: a dataset's examples, tokenized once, in a file that later runs read instead
//! of tokenizing again. A file is named by its key, a hash of everything that shapes the
//! examples (the data files' bytes, the tokenizer's and its template's, the masking, the
//! columns, and this cache's format and autotune's version), so a changed input is a different
//! key and never served stale. Examples are stored before they are cut to a sequence length, so
//! one file serves every length.
//!
//! Layout (little-endian, every section aligned to its type):
//! a 96-byte header (`MAGIC`, the key in hex, the example and token counts), then the examples'
//! starts (`u64` × examples + 1), their ids (`u32` × tokens) and their trained flags
//! (`u8` × tokens).
//!
//! A file is written whole to a temporary name and renamed into place, never changed after: a
//! run that has one open keeps reading the file it opened even if another run replaces it.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use super::table::{ExampleTable, Layout};
use crate::{Error, Result};

/// The first bytes of a cache file, with its format's version.
const MAGIC: &[u8; 8] = b"ATTOKC01";
/// Bytes before the first section.
const HEADER: usize = 96;
/// Hex digits of a key.
const KEY_LEN: usize = 64;

/// What a lookup found.
pub enum Lookup {
    /// The examples, read from the file as batches need them.
    Hit(ExampleTable),
    /// No file for the key.
    Missing,
    /// A file that cannot be read as the key's examples, and why: it will be written again.
    Unreadable(String),
}

/// A folder of cached examples.
#[derive(Debug, Clone)]
pub struct TokenCache {
    dir: PathBuf,
}

impl TokenCache {
    /// The cache in `dir` (created on the first store).
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    /// The file of `key`'s examples.
    pub fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.tokens"))
    }

    /// The examples stored under `key`.
    pub fn lookup(&self, key: &str) -> Result<Lookup> {
        let path = self.path(key);
        let file = match crate::input_file::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Lookup::Missing),
            Err(e) => return Err(Error::file("cannot read the token cache", &path, e)),
        };
        let len = file
            .metadata()
            .map_err(|e| Error::file("cannot read the token cache", &path, e))?
            .len();
        let mut head = [0u8; HEADER];
        if len < HEADER as u64 {
            return Ok(Lookup::Unreadable(
                "not a token cache of this version".into(),
            ));
        }
        file.read_exact_at(&mut head, 0)
            .map_err(|e| Error::file("cannot read the token cache", &path, e))?;
        Ok(match layout(&head, len, key) {
            Ok(layout) => match ExampleTable::read_from(file, path, layout) {
                Ok(table) => Lookup::Hit(table),
                Err(problem) => Lookup::Unreadable(problem),
            },
            Err(problem) => Lookup::Unreadable(problem),
        })
    }

    /// Stores `table` under `key`, replacing any file there.
    pub fn store(&self, key: &str, table: &ExampleTable) -> Result<PathBuf> {
        let path = self.path(key);
        let Some(runs) = table.runs() else {
            return Err(Error::internal(
                "a table read from the token cache is stored again",
            ));
        };
        let written = autotune_core::atomic_file::write_with(&path, |out| {
            out.write_all(&header(key, table.len() as u64, runs.ids.len() as u64))?;
            out.write_all(bytemuck::cast_slice(runs.starts))?;
            out.write_all(bytemuck::cast_slice(runs.ids))?;
            out.write_all(runs.trained)
        });
        written.map_err(|e| Error::file("cannot write the token cache", &path, e))?;
        Ok(path)
    }
}

/// The header of a file of `examples` examples and `tokens` tokens under `key`.
fn header(key: &str, examples: u64, tokens: u64) -> [u8; HEADER] {
    let mut header = [0u8; HEADER];
    header[..8].copy_from_slice(MAGIC);
    let key = key.as_bytes();
    header[8..8 + key.len().min(KEY_LEN)].copy_from_slice(&key[..key.len().min(KEY_LEN)]);
    header[72..80].copy_from_slice(&examples.to_le_bytes());
    header[80..88].copy_from_slice(&tokens.to_le_bytes());
    header
}

/// Where the sections lie in a file of `len` bytes that starts with `head`, if it is a cache
/// file of `key` whose length matches its counts.
fn layout(head: &[u8; HEADER], len: u64, key: &str) -> std::result::Result<Layout, String> {
    if cfg!(target_endian = "big") {
        return Err("the cache is little-endian and this machine is not".into());
    }
    if &head[..8] != MAGIC {
        return Err("not a token cache of this version".into());
    }
    let (examples, tokens) = (count(head, 72), count(head, 80));
    if head != &header(key, examples, tokens) {
        return Err("its header names another key".into());
    }
    let sizes = examples.checked_add(1).and_then(|e| {
        let starts = e.checked_mul(8)?;
        let ids = tokens.checked_mul(4)?;
        let end = (HEADER as u64)
            .checked_add(starts)?
            .checked_add(ids)?
            .checked_add(tokens)?;
        Some((starts, ids, end))
    });
    let Some((starts, ids, end)) = sizes else {
        return Err("its counts are out of range".into());
    };
    if end != len {
        return Err(format!("it is {len} bytes long and its counts say {end}"));
    }
    let header = HEADER as u64;
    Ok(Layout {
        starts: header..header + starts,
        ids: header + starts..header + starts + ids,
        trained: header + starts + ids..end,
    })
}

/// The `u64` at `at`.
fn count(map: &[u8], at: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&map[at..at + 8]);
    u64::from_le_bytes(bytes)
}

/// The default cache folder, shared by every run: `$XDG_CACHE_HOME/autotune/tokens`, else
/// `~/.cache/autotune/tokens`.
pub fn default_dir() -> PathBuf {
    let home_cache = || std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache"));
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(home_cache)
        .unwrap_or_else(std::env::temp_dir)
        .join("autotune")
        .join("tokens")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::dataset::Example;

    fn table() -> ExampleTable {
        ExampleTable::new(&[
            Example {
                ids: vec![5, 6, 7],
                trained: vec![false, true, true],
            },
            Example {
                ids: vec![8, 9],
                trained: vec![true, false],
            },
        ])
    }

    fn key(c: char) -> String {
        std::iter::repeat_n(c, KEY_LEN).collect()
    }

    #[test]
    fn a_stored_table_reads_back_whole_under_its_key_only() {
        let dir = tempfile::tempdir().unwrap();
        let cache = TokenCache::new(dir.path().join("cache"));
        assert!(matches!(cache.lookup(&key('a')).unwrap(), Lookup::Missing));
        cache.store(&key('a'), &table()).unwrap();
        let Lookup::Hit(cached) = cache.lookup(&key('a')).unwrap() else {
            panic!("the stored table")
        };
        assert!(cached.is_cached());
        assert_eq!(cached.len(), 2);
        for i in 0..2 {
            assert_eq!(cached.example(i).unwrap(), table().example(i).unwrap());
        }
        assert!(matches!(cache.lookup(&key('b')).unwrap(), Lookup::Missing));
        std::fs::copy(cache.path(&key('a')), cache.path(&key('b'))).unwrap();
        assert!(
            matches!(cache.lookup(&key('b')).unwrap(), Lookup::Unreadable(_)),
            "a file under another key's name is not served"
        );
    }

    #[test]
    fn a_damaged_file_is_unreadable_not_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let cache = TokenCache::new(dir.path().to_path_buf());
        let path = cache.store(&key('c'), &table()).unwrap();
        let whole = std::fs::read(&path).unwrap();
        let mut out_of_order = whole.clone();
        out_of_order[HEADER + 8] = 200;
        for (bytes, what) in [
            (whole[..whole.len() - 1].to_vec(), "cut short"),
            ([whole.clone(), vec![0]].concat(), "too long"),
            (whole[..20].to_vec(), "only a header's start"),
            (out_of_order, "starts out of order"),
            (b"not a cache at all".to_vec(), "another file"),
        ] {
            std::fs::write(&path, &bytes).unwrap();
            assert!(
                matches!(cache.lookup(&key('c')).unwrap(), Lookup::Unreadable(_)),
                "{what}"
            );
        }
    }

    #[test]
    fn a_file_cut_short_under_a_table_that_reads_it_is_a_data_change_not_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let cache = TokenCache::new(dir.path().to_path_buf());
        let path = cache.store(&key('d'), &table()).unwrap();
        let Lookup::Hit(cached) = cache.lookup(&key('d')).unwrap() else {
            panic!("the stored table")
        };
        // Keep the header and the starts, which the table has read; lose the ids.
        let kept = (HEADER + 3 * 8 + 4) as u64;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(kept)
            .unwrap();
        assert_eq!(cached.len(), 2, "the starts were read when the file was");
        match cached.get(1) {
            Err(Error::DataChanged {
                path: named,
                problem,
                ..
            }) => {
                assert_eq!(named, path);
                assert!(problem.contains("token cache"), "{problem}");
            }
            other => panic!("a data change, not {other:?}"),
        }
    }
}
