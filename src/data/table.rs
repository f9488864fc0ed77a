//! Tokenized examples stored flat: one run of token ids, one of trained flags, and where each
//! example starts. A table is built in memory from tokenized examples, or read from a file of
//! the token cache ([`super::cache`]) so that a dataset far larger than memory costs only the
//! examples a batch reads.
//!
//! Why a cached table reads its examples by position and does not map the file: a file cut
//! short under a mapping (a hand edit, a disk cleaned up) kills the process with SIGBUS at the
//! next page it touches, with no message and no checkpoint. A positioned read past the new end
//! comes back short instead, which becomes [`Error::DataChanged`], and the training loop saves
//! a checkpoint before it stops.

use std::borrow::Cow;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use super::dataset::Example;
use crate::{Error, Result};

/// A table's three runs, borrowed: example `i` is `ids[starts[i]..starts[i + 1]]`.
#[derive(Debug, Clone, Copy)]
pub struct Runs<'a> {
    /// Where each example starts in `ids`, and (last) where the final one ends.
    pub starts: &'a [u64],
    /// Every example's token ids, one after another.
    pub ids: &'a [u32],
    /// For each id, 1 where the loss trains on it.
    pub trained: &'a [u8],
}

/// Where a cached table's runs lie in its file, in bytes.
#[derive(Debug, Clone)]
pub(super) struct Layout {
    pub starts: Range<u64>,
    pub ids: Range<u64>,
    pub trained: Range<u64>,
}

/// The ids and trained flags of a table read from a file, by position; the starts, a small
/// share of the file, are read once and held.
struct CachedRuns {
    file: std::fs::File,
    path: PathBuf,
    starts: Vec<u64>,
    layout: Layout,
}

enum Store {
    Owned {
        starts: Vec<u64>,
        ids: Vec<u32>,
        trained: Vec<u8>,
    },
    /// Starts checked by [`ExampleTable::read_from`]: in order and within the ids.
    Cached(CachedRuns),
}

/// Tokenized examples, in dataset order.
pub struct ExampleTable {
    store: Store,
}

/// One example's token ids and trained flags (1 where the loss trains on the id), borrowed
/// from a table in memory or read from its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExampleTokens<'a> {
    /// The token ids.
    pub ids: Cow<'a, [u32]>,
    /// For each id, 1 where the loss trains on it.
    pub trained: Cow<'a, [u8]>,
}

impl std::fmt::Debug for ExampleTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExampleTable")
            .field("examples", &self.len())
            .field("tokens", &self.starts().last().copied().unwrap_or(0))
            .field("cached", &self.is_cached())
            .finish()
    }
}

impl ExampleTable {
    /// The table of `examples`.
    pub fn new(examples: &[Example]) -> Self {
        let total: usize = examples.iter().map(|e| e.ids.len()).sum();
        let mut starts = Vec::with_capacity(examples.len() + 1);
        let mut ids = Vec::with_capacity(total);
        let mut trained = Vec::with_capacity(total);
        starts.push(0);
        for example in examples {
            ids.extend_from_slice(&example.ids);
            trained.extend(example.trained.iter().map(|&t| u8::from(t)));
            starts.push(ids.len() as u64);
        }
        Self {
            store: Store::Owned {
                starts,
                ids,
                trained,
            },
        }
    }

    /// The table whose runs lie in `file` (named `path`) at `layout`, its starts read now, or
    /// why it cannot be read: starts out of order, or not ending where the ids do.
    pub(super) fn read_from(
        file: std::fs::File,
        path: PathBuf,
        layout: Layout,
    ) -> std::result::Result<Self, String> {
        let bytes = usize::try_from(layout.starts.end - layout.starts.start)
            .map_err(|_| "its example count is out of range".to_string())?;
        let mut starts = vec![0u64; bytes / 8];
        file.read_exact_at(bytemuck::cast_slice_mut(&mut starts), layout.starts.start)
            .map_err(|e| format!("its example starts cannot be read: {e}"))?;
        for start in &mut starts {
            *start = u64::from_le(*start);
        }
        let tokens = (layout.ids.end - layout.ids.start) / 4;
        let ordered = starts.windows(2).all(|w| w[0] <= w[1]);
        if starts.first() != Some(&0) || starts.last() != Some(&tokens) || !ordered {
            return Err("the example starts are out of order".into());
        }
        Ok(Self {
            store: Store::Cached(CachedRuns {
                file,
                path,
                starts,
                layout,
            }),
        })
    }

    /// The table's runs where it holds them in memory; `None` for a table read from a file.
    pub fn runs(&self) -> Option<Runs<'_>> {
        match &self.store {
            Store::Owned {
                starts,
                ids,
                trained,
            } => Some(Runs {
                starts,
                ids,
                trained,
            }),
            Store::Cached(_) => None,
        }
    }

    fn starts(&self) -> &[u64] {
        match &self.store {
            Store::Owned { starts, .. } => starts,
            Store::Cached(cached) => &cached.starts,
        }
    }

    /// How many examples the table holds.
    pub fn len(&self) -> usize {
        self.starts().len().saturating_sub(1)
    }

    /// Whether the table holds no example.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many tokens example `i` holds.
    pub fn length(&self, i: usize) -> usize {
        let starts = self.starts();
        (starts[i + 1] - starts[i]) as usize
    }

    /// Where example `i`'s tokens lie among all of the table's.
    fn span(&self, i: usize) -> Range<usize> {
        let starts = self.starts();
        starts[i] as usize..starts[i + 1] as usize
    }

    /// Example `i`'s token ids and trained flags. A cache file cut short since it was read is
    /// [`Error::DataChanged`].
    pub fn get(&self, i: usize) -> Result<ExampleTokens<'_>> {
        Ok(ExampleTokens {
            ids: self.ids(i)?,
            trained: self.trained(i)?,
        })
    }

    /// Example `i`'s token ids.
    pub fn ids(&self, i: usize) -> Result<Cow<'_, [u32]>> {
        let span = self.span(i);
        match &self.store {
            Store::Owned { ids, .. } => Ok(Cow::Borrowed(&ids[span])),
            Store::Cached(cached) => {
                let mut ids = vec![0u32; span.len()];
                cached.read(
                    bytemuck::cast_slice_mut(&mut ids),
                    &cached.layout.ids,
                    span,
                    4,
                )?;
                ids.iter_mut().for_each(|id| *id = u32::from_le(*id));
                Ok(Cow::Owned(ids))
            }
        }
    }

    /// Example `i`'s trained flags: 1 where the loss trains on the id.
    pub fn trained(&self, i: usize) -> Result<Cow<'_, [u8]>> {
        let span = self.span(i);
        match &self.store {
            Store::Owned { trained, .. } => Ok(Cow::Borrowed(&trained[span])),
            Store::Cached(cached) => {
                let mut trained = vec![0u8; span.len()];
                cached.read(&mut trained, &cached.layout.trained, span, 1)?;
                Ok(Cow::Owned(trained))
            }
        }
    }

    /// Example `i`, copied out.
    pub fn example(&self, i: usize) -> Result<Example> {
        let tokens = self.get(i)?;
        Ok(tokens.to_example())
    }

    /// Whether the table is read from a cache file rather than held in memory.
    pub fn is_cached(&self) -> bool {
        matches!(self.store, Store::Cached(_))
    }
}

impl ExampleTokens<'_> {
    /// The tokens as an [`Example`].
    pub fn to_example(&self) -> Example {
        Example {
            ids: self.ids.to_vec(),
            trained: self.trained.iter().map(|&t| t != 0).collect(),
        }
    }
}

impl CachedRuns {
    /// Reads the values `span` (of `width` bytes each) of the section at `section` into `out`.
    fn read(
        &self,
        out: &mut [u8],
        section: &Range<u64>,
        span: Range<usize>,
        width: u64,
    ) -> Result<()> {
        let at = section.start + span.start as u64 * width;
        match self.file.read_exact_at(out, at) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(Error::DataChanged {
                path: self.path.clone(),
                problem: format!(
                    "this token cache file was {} bytes long when the run started and now ends \
                     before byte {}; a resume tokenizes the data again",
                    self.layout.trained.end,
                    at + out.len() as u64
                ),
                checkpoint: None,
            }),
            Err(e) => Err(Error::file("cannot read the token cache", &self.path, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn examples_come_back_as_they_went_in() {
        let examples = vec![
            Example {
                ids: vec![1, 2, 3],
                trained: vec![false, true, true],
            },
            Example {
                ids: vec![],
                trained: vec![],
            },
            Example {
                ids: vec![9],
                trained: vec![true],
            },
        ];
        let table = ExampleTable::new(&examples);
        assert_eq!(table.len(), 3);
        for (i, example) in examples.iter().enumerate() {
            assert_eq!(&table.example(i).unwrap(), example);
            assert_eq!(table.length(i), example.ids.len());
        }
        let first = table.get(0).unwrap();
        assert_eq!(
            (&*first.ids, &*first.trained),
            (&[1, 2, 3][..], &[0, 1, 1][..])
        );
        assert!(!table.is_cached());
        assert!(ExampleTable::new(&[]).is_empty());
    }
}
