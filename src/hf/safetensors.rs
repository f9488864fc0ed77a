//! safetensors checkpoints read one tensor at a time (a file, or the shards an index lists) and
//! written streaming, with the metadata `transformers` checks (`format: pt`).
//!
//! Reading goes through [`SafetensorsFile`], so loading a sharded 8B checkpoint never holds
//! more than one tensor beside the model. Writing emits the header first, from the shapes
//! alone, and then each tensor's values as they come, converted to the file's dtype on the way.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

pub(super) use crate::train::tensor_reader::bad;
pub use crate::train::tensor_reader::SafetensorsFile;
use crate::{Error, Result};

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
