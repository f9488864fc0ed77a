//! safetensors files read one tensor at a time, nothing trusted: the header's length is
//! bounded, and every tensor's dtype, shape and byte range are checked against the file when
//! it is opened, before a byte of data is read, so a crafted header is refused instead of
//! allocating what it claims.
//!
//! Each tensor's bytes are read at their offset (no memory map, so nothing here is unsafe, and
//! a file cut short is an error, not a fault). Hugging Face weights and a checkpoint's state
//! both read through here.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::{Error, Result};

/// The largest header read: far above any real one (an 8B model's is under 100 KB), small
/// enough that a corrupt length cannot exhaust memory.
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// One tensor's place in a file.
#[derive(Debug, Clone)]
struct Entry {
    dtype: DType,
    shape: Vec<usize>,
    /// Byte range after the header.
    start: u64,
    end: u64,
}

/// An open safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    file: File,
    data_start: u64,
    tensors: BTreeMap<String, Entry>,
}

/// The error for weights at `path` that cannot be used, and why.
pub(crate) fn bad(path: &Path, problem: impl Into<String>) -> Error {
    Error::Weights {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// What a file may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holds {
    /// Weights: F32, BF16 or F16.
    Weights,
    /// A checkpoint's optimizer state: those, and the U8 codes of compact moments.
    State,
}

fn dtype_of(name: &str, holds: Holds) -> Option<DType> {
    match name {
        "F32" => Some(DType::F32),
        "BF16" => Some(DType::BF16),
        "F16" => Some(DType::F16),
        "U8" if holds == Holds::State => Some(DType::U8),
        _ => None,
    }
}

impl SafetensorsFile {
    /// Opens `path` and checks its header: every tensor of a float dtype we read, its byte range
    /// the size its shape says and inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_holding(path, Holds::Weights)
    }

    /// [`SafetensorsFile::open`] for a checkpoint's state, which may hold U8 codes too.
    pub fn open_state(path: &Path) -> Result<Self> {
        Self::open_holding(path, Holds::State)
    }

    fn open_holding(path: &Path, holds: Holds) -> Result<Self> {
        let mut file =
            crate::input_file::open(path).map_err(|e| Error::file("cannot open", path, e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::file("cannot read", path, e))?
            .len();
        let mut size = [0u8; 8];
        file.read_exact(&mut size)
            .map_err(|_| bad(path, "is shorter than a safetensors header"))?;
        let header_len = u64::from_le_bytes(size);
        if header_len > MAX_HEADER_BYTES || 8 + header_len > len {
            return Err(bad(
                path,
                format!("has a header length of {header_len} bytes, past the file"),
            ));
        }
        let mut header = vec![0u8; header_len as usize];
        file.read_exact(&mut header)
            .map_err(|e| Error::file("cannot read", path, e))?;
        let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
            .map_err(|e| bad(path, format!("has a header that is not a JSON object: {e}")))?;
        let data_start = 8 + header_len;
        let mut tensors = BTreeMap::new();
        for (name, info) in header {
            if name == "__metadata__" {
                continue;
            }
            let field = |key: &str| {
                info.get(key)
                    .ok_or_else(|| bad(path, format!("tensor `{name}` has no `{key}`")))
            };
            let dtype_name = field("dtype")?.as_str().unwrap_or("");
            let dtype = dtype_of(dtype_name, holds).ok_or_else(|| {
                bad(
                    path,
                    format!("tensor `{name}` is {dtype_name}; weights must be F32, BF16 or F16"),
                )
            })?;
            let shape: Vec<usize> = serde_json::from_value(field("shape")?.clone())
                .map_err(|_| bad(path, format!("tensor `{name}` has a malformed shape")))?;
            let offsets: [u64; 2] = serde_json::from_value(field("data_offsets")?.clone())
                .map_err(|_| bad(path, format!("tensor `{name}` has malformed data_offsets")))?;
            let elements = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64));
            let bytes = elements.and_then(|n| n.checked_mul(dtype.size_in_bytes() as u64));
            let fits = offsets[0] <= offsets[1]
                && data_start.checked_add(offsets[1]).is_some_and(|e| e <= len);
            if bytes != Some(offsets[1] - offsets[0].min(offsets[1])) || !fits {
                return Err(bad(path, format!("tensor `{name}`'s bytes do not match its shape {shape:?} or lie past the file")));
            }
            tensors.insert(
                name,
                Entry {
                    dtype,
                    shape,
                    start: offsets[0],
                    end: offsets[1],
                },
            );
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            data_start,
            tensors,
        })
    }

    /// The tensors' names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The shape of tensor `name`, if the file has it.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|e| e.shape.as_slice())
    }

    /// Reads tensor `name` in its stored dtype onto the CPU.
    pub fn read(&self, name: &str) -> Result<Tensor> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| bad(&self.path, format!("has no tensor `{name}`")))?;
        let mut bytes = vec![0u8; (e.end - e.start) as usize];
        self.file
            .read_exact_at(&mut bytes, self.data_start + e.start)
            .map_err(|err| Error::file("cannot read", &self.path, err))?;
        Ok(Tensor::from_raw_buffer(
            &bytes,
            e.dtype,
            &e.shape,
            &Device::Cpu,
        )?)
    }
}
