//! safetensors files read one tensor at a time and written streaming, with the metadata
//! `transformers` checks (`format: pt`).
//!
//! Reading parses the header once and then reads each tensor's bytes at its offset, so loading
//! a sharded 8B checkpoint never holds more than one tensor beside the model (no memory map, so
//! nothing here is unsafe). Writing emits the header first, from the shapes alone, and then each
//! tensor's values as they come, converted to the file's dtype on the way.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Read, Write};
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

pub(super) fn bad(path: &Path, problem: impl Into<String>) -> Error {
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

/// A checkpoint folder: `model.safetensors`, or the shards a `model.safetensors.index.json`
/// lists, or a single `.safetensors` file given directly.
pub struct Checkpoint {
    path: PathBuf,
    files: Vec<SafetensorsFile>,
    /// Which file holds each tensor.
    index: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens the checkpoint at `path` (a folder or a file).
    pub fn open(path: &Path) -> Result<Self> {
        let files = super::checkpoint_files::of(path)?;
        let files = files
            .iter()
            .map(|f| SafetensorsFile::open(f))
            .collect::<Result<Vec<_>>>()?;
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for name in f.names() {
                if index.insert(name.to_string(), i).is_some() {
                    return Err(bad(path, format!("holds tensor `{name}` twice")));
                }
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            files,
            index,
        })
    }

    /// Where the checkpoint was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every tensor's name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The shape of tensor `name`, if the checkpoint has it.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.index
            .get(name)
            .and_then(|&i| self.files[i].shape(name))
    }

    /// Reads tensor `name` onto the CPU in its stored dtype.
    pub fn read(&self, name: &str) -> Result<Tensor> {
        match self.index.get(name) {
            Some(&i) => self.files[i].read(name),
            None => Err(bad(&self.path, format!("has no tensor `{name}`"))),
        }
    }
}

/// A safetensors file written streaming: the header from the shapes first, then each
/// tensor's values in order, through a temporary file renamed into place at the end.
pub struct Writer {
    path: PathBuf,
    tmp: PathBuf,
    out: BufWriter<File>,
    dtype: DType,
    shapes: Vec<(String, Vec<usize>)>,
    next: usize,
    /// Renamed into place: nothing to clean up.
    finished: bool,
}

impl Drop for Writer {
    fn drop(&mut self) {
        // A writer abandoned part-way (an error while filling it) leaves no partial file.
        if !self.finished {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

impl Writer {
    /// Starts `path` with the tensors `shapes` (in the order they will be written), stored in
    /// `dtype` (F32, BF16 or F16), and `metadata` in the header.
    pub fn create(
        path: &Path,
        shapes: Vec<(String, Vec<usize>)>,
        dtype: DType,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Self> {
        let code = match dtype {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            other => {
                return Err(Error::internal(format!(
                    "safetensors writer: no {other:?} output"
                )))
            }
        };
        let tensors: Vec<(&str, &[usize])> = shapes
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        let header = crate::train::tensor_file::header(
            &tensors,
            code,
            dtype.size_in_bytes(),
            Some(metadata),
        )
        .map_err(|e| Error::internal(e.to_string()))?;
        let tmp = path.with_extension(format!("safetensors.tmp-{}", std::process::id()));
        let file = File::create(&tmp).map_err(|e| Error::file("cannot create", &tmp, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let io = |e| Error::file("cannot write", &tmp, e);
        out.write_all(&header).map_err(io)?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp,
            out,
            dtype,
            shapes,
            next: 0,
            finished: false,
        })
    }

    /// Writes the next tensor (any float dtype, any device; it must have the announced shape).
    pub fn write(&mut self, tensor: &Tensor) -> Result<()> {
        let Some((name, shape)) = self.shapes.get(self.next) else {
            return Err(Error::internal(
                "safetensors writer: more tensors than announced",
            ));
        };
        if tensor.dims() != shape.as_slice() {
            return Err(Error::internal(format!(
                "safetensors writer: `{name}` is {:?}, announced {shape:?}",
                tensor.dims()
            )));
        }
        let t = tensor
            .to_device(&Device::Cpu)?
            .to_dtype(self.dtype)?
            .flatten_all()?;
        let io = |e| Error::file("cannot write", &self.tmp, e);
        match self.dtype {
            DType::F32 => {
                for v in t.to_vec1::<f32>()? {
                    self.out.write_all(&v.to_le_bytes()).map_err(io)?;
                }
            }
            DType::BF16 => {
                for v in t.to_vec1::<half::bf16>()? {
                    self.out.write_all(&v.to_le_bytes()).map_err(io)?;
                }
            }
            _ => {
                for v in t.to_vec1::<half::f16>()? {
                    self.out.write_all(&v.to_le_bytes()).map_err(io)?;
                }
            }
        }
        self.next += 1;
        Ok(())
    }

    /// Checks every tensor was written, syncs the file and renames it into place.
    pub fn finish(mut self) -> Result<()> {
        if self.next != self.shapes.len() {
            return Err(Error::internal(format!(
                "safetensors writer: {} of {} tensors written",
                self.next,
                self.shapes.len()
            )));
        }
        let io = |e| Error::file("cannot write", &self.tmp, e);
        self.out.flush().map_err(io)?;
        self.out.get_ref().sync_all().map_err(io)?;
        std::fs::rename(&self.tmp, &self.path)
            .map_err(|e| Error::file("cannot move into place", &self.path, e))?;
        self.finished = true;
        Ok(())
    }
}
