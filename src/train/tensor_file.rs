//! Writes f32 slices as a safetensors file without first copying them into tensors.
//!
//! The offloaded optimizer keeps its masters and moments in flat host buffers. Turning them into
//! candle tensors for `candle_core::safetensors::save` would copy all of them at once (12 bytes
//! per parameter on top of the 16 the state already takes); streaming through a small buffer
//! keeps a checkpoint's extra host memory constant. The layout is the standard one (little-endian
//! header length, JSON header, data), so `candle_core::safetensors::load` reads it back.

use std::io::Write;

/// One tensor to write: its name, shape and values (row-major).
pub struct Entry<'a> {
    /// Tensor name in the file.
    pub name: &'a str,
    /// Dimensions.
    pub shape: &'a [usize],
    /// Values; their number is the product of `shape`.
    pub values: &'a [f32],
}

/// Values converted per write: bounds the staging buffer at 256 KiB.
const VALUES_PER_WRITE: usize = 1 << 16;

/// The header of a safetensors file, its length first: tensors `(name, shape)` stored back to
/// back in the order given, in the format's dtype `code` of `element_bytes` each, and
/// `metadata` under `__metadata__` when given. The data follows it.
pub fn header(
    tensors: &[(&str, &[usize])],
    code: &str,
    element_bytes: usize,
    metadata: Option<&std::collections::BTreeMap<String, String>>,
) -> std::io::Result<Vec<u8>> {
    let mut header = serde_json::Map::new();
    if let Some(metadata) = metadata {
        header.insert(
            "__metadata__".into(),
            serde_json::to_value(metadata).map_err(std::io::Error::other)?,
        );
    }
    let mut offset = 0usize;
    for (name, shape) in tensors {
        let end = offset + element_bytes * shape.iter().product::<usize>();
        header.insert(
            name.to_string(),
            serde_json::json!({ "dtype": code, "shape": shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut header = serde_json::to_vec(&header).map_err(std::io::Error::other)?;
    // The format pads the header with spaces so that the data starts 8-byte aligned.
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    Ok(out)
}

/// Writes `entries` as an f32 safetensors file to `out`.
pub fn write_f32<W: Write>(mut out: W, entries: &[Entry<'_>]) -> std::io::Result<()> {
    for e in entries {
        let count: usize = e.shape.iter().product();
        if count != e.values.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "tensor `{}`: shape {:?} does not hold {} values",
                    e.name,
                    e.shape,
                    e.values.len()
                ),
            ));
        }
    }
    let tensors: Vec<(&str, &[usize])> = entries.iter().map(|e| (e.name, e.shape)).collect();
    out.write_all(&header(&tensors, "F32", 4, None)?)?;
    let mut bytes = Vec::with_capacity(4 * VALUES_PER_WRITE);
    for e in entries {
        for chunk in e.values.chunks(VALUES_PER_WRITE) {
            bytes.clear();
            chunk
                .iter()
                .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
            out.write_all(&bytes)?;
        }
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candle_reads_what_is_written() -> crate::Result<()> {
        let dir = tempfile::tempdir().map_err(candle_core::Error::wrap)?;
        let path = dir.path().join("t.safetensors");
        let a: Vec<f32> = (0..100_000).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b = [1.0f32, -0.0, f32::MIN_POSITIVE];
        let file = std::fs::File::create(&path).map_err(candle_core::Error::wrap)?;
        write_f32(
            std::io::BufWriter::new(file),
            &[
                Entry {
                    name: "a.weight",
                    shape: &[1000, 100],
                    values: &a,
                },
                Entry {
                    name: "b",
                    shape: &[3],
                    values: &b,
                },
            ],
        )
        .map_err(candle_core::Error::wrap)?;
        let loaded = candle_core::safetensors::load(&path, &candle_core::Device::Cpu)?;
        assert_eq!(loaded["a.weight"].dims(), [1000, 100]);
        assert_eq!(loaded["a.weight"].flatten_all()?.to_vec1::<f32>()?, a);
        let b_back: Vec<u32> = loaded["b"]
            .to_vec1::<f32>()?
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(b_back, b.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        Ok(())
    }
}
