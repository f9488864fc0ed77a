//! Tokenized examples stored flat: one run of token ids, one of trained flags, and where each
//! example starts. A table is built in memory from tokenized examples, or mapped from the token
//! cache ([`super::cache`]) so that a dataset far larger than memory costs only the pages a
//! batch touches.

use memmap2::Mmap;

use super::dataset::Example;

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

/// Where a mapped table's runs lie in its file, in bytes.
#[derive(Debug, Clone)]
pub(super) struct Layout {
    pub starts: std::ops::Range<usize>,
    pub ids: std::ops::Range<usize>,
    pub trained: std::ops::Range<usize>,
}

enum Store {
    Owned {
        starts: Vec<u64>,
        ids: Vec<u32>,
        trained: Vec<u8>,
    },
    /// Runs checked by [`ExampleTable::mapped`]: aligned, sized and in order.
    Mapped { map: Mmap, layout: Layout },
}

/// Tokenized examples, in dataset order.
pub struct ExampleTable {
    store: Store,
}

impl std::fmt::Debug for ExampleTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExampleTable")
            .field("examples", &self.len())
            .field("tokens", &self.runs().ids.len())
            .field("mapped", &self.is_mapped())
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

    /// The table whose runs lie in `map` at `layout`, or why they cannot be read: a run out of
    /// the file, misaligned, of the wrong length, or starts out of order.
    pub(super) fn mapped(map: Mmap, layout: Layout) -> Result<Self, String> {
        let table = Self {
            store: Store::Mapped { map, layout },
        };
        table.check()?;
        Ok(table)
    }

    fn check(&self) -> Result<(), String> {
        if let Store::Mapped { map, layout } = &self.store {
            for range in [&layout.starts, &layout.ids, &layout.trained] {
                if range.end > map.len() || range.start > range.end {
                    return Err("a section lies past the end of the file".into());
                }
            }
            let starts = bytemuck::try_cast_slice::<u8, u64>(&map[layout.starts.clone()]);
            let ids = bytemuck::try_cast_slice::<u8, u32>(&map[layout.ids.clone()]);
            if starts.is_err() || ids.is_err() {
                return Err("a section is not aligned to its type".into());
            }
        }
        let runs = self.runs();
        let ordered = runs.starts.windows(2).all(|w| w[0] <= w[1]);
        let tokens = runs.ids.len() as u64;
        if runs.starts.first() != Some(&0) || runs.starts.last() != Some(&tokens) || !ordered {
            return Err("the example starts are out of order".into());
        }
        if runs.trained.len() != runs.ids.len() {
            return Err("the trained flags do not match the ids".into());
        }
        Ok(())
    }

    /// The table's runs.
    pub fn runs(&self) -> Runs<'_> {
        match &self.store {
            Store::Owned {
                starts,
                ids,
                trained,
            } => Runs {
                starts,
                ids,
                trained,
            },
            // Checked aligned and sized when the table was mapped.
            Store::Mapped { map, layout } => Runs {
                starts: bytemuck::cast_slice(&map[layout.starts.clone()]),
                ids: bytemuck::cast_slice(&map[layout.ids.clone()]),
                trained: &map[layout.trained.clone()],
            },
        }
    }

    /// How many examples the table holds.
    pub fn len(&self) -> usize {
        self.runs().starts.len().saturating_sub(1)
    }

    /// Whether the table holds no example.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Example `i`'s token ids and trained flags.
    pub fn get(&self, i: usize) -> (&[u32], &[u8]) {
        let runs = self.runs();
        let (start, end) = (runs.starts[i] as usize, runs.starts[i + 1] as usize);
        (&runs.ids[start..end], &runs.trained[start..end])
    }

    /// Example `i`, copied out.
    pub fn example(&self, i: usize) -> Example {
        let (ids, trained) = self.get(i);
        Example {
            ids: ids.to_vec(),
            trained: trained.iter().map(|&t| t != 0).collect(),
        }
    }

    /// Whether the table is mapped from a file rather than held in memory.
    pub fn is_mapped(&self) -> bool {
        matches!(self.store, Store::Mapped { .. })
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
            assert_eq!(&table.example(i), example);
        }
        assert_eq!(table.get(0), (&[1, 2, 3][..], &[0, 1, 1][..]));
        assert!(!table.is_mapped());
        assert!(ExampleTable::new(&[]).is_empty());
    }
}
