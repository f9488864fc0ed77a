//! A checkpoint's manifest: the length and SHA-256 of every file in it, written last and
//! checked before a resume reads anything else, so that flipped bytes, a truncated copy or a
//! file swapped in from another checkpoint is refused instead of trained on.

use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// What a checkpoint holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Every file of the checkpoint but the manifest itself.
    pub files: Vec<FileDigest>,
}

/// One file's length and digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDigest {
    /// Its name inside the checkpoint directory.
    pub name: String,
    /// Its length in bytes.
    pub bytes: u64,
    /// Its SHA-256, lowercase hex.
    pub sha256: String,
}

impl Manifest {
    /// Digests the `names` files of `dir` as they are on disk now.
    pub fn of(dir: &Path, names: &[&str]) -> Result<Self> {
        let files = names
            .iter()
            .map(|name| {
                let path = dir.join(name);
                let (bytes, sha256) =
                    digest(&path).map_err(|e| Error::file("cannot read back", &path, e))?;
                Ok(FileDigest {
                    name: name.to_string(),
                    bytes,
                    sha256,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { files })
    }

    /// Writes the manifest into `dir`, synced.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let json = serde_json::to_vec_pretty(self).expect("a manifest always serialises");
        super::write_synced(&dir.join(MANIFEST_FILE), &json)
    }

    /// Reads `dir`'s manifest.
    pub fn read(dir: &Path) -> std::result::Result<Self, String> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("its manifest `{}` cannot be read ({e})", path.display()))?;
        autotune_core::json::from_str("checkpoint manifest", &text)
            .map_err(|e| format!("its manifest `{}` is not one ({e})", path.display()))
    }

    /// What is wrong with `dir`'s files against this manifest, if anything.
    pub fn damage(&self, dir: &Path) -> Option<String> {
        for file in &self.files {
            let path = dir.join(&file.name);
            let (bytes, sha256) = match digest(&path) {
                Ok(found) => found,
                Err(e) => return Some(format!("`{}` cannot be read ({e})", file.name)),
            };
            if bytes != file.bytes {
                return Some(format!(
                    "`{}` is {bytes} bytes, but was written as {}",
                    file.name, file.bytes
                ));
            }
            if sha256 != file.sha256 {
                return Some(format!(
                    "`{}` does not match its checksum (SHA-256 {sha256}, written as {})",
                    file.name, file.sha256
                ));
            }
        }
        None
    }
}

/// Whether the checkpoint in `dir` is intact: `Err` says what is damaged.
pub fn verify(dir: &Path) -> std::result::Result<(), String> {
    let manifest = Manifest::read(dir)?;
    match manifest.damage(dir) {
        Some(damage) => Err(damage),
        None => Ok(()),
    }
}

/// A file's length and SHA-256, read in blocks.
fn digest(path: &Path) -> std::io::Result<(u64, String)> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        total += n as u64;
    }
    let hex = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>();
    Ok((total, hex))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flipped_byte_a_truncation_or_a_missing_file_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("a.bin"), b"0123456789").unwrap();
        std::fs::write(d.join("b.json"), b"{}").unwrap();
        Manifest::of(d, &["a.bin", "b.json"])
            .unwrap()
            .write(d)
            .unwrap();
        assert_eq!(verify(d), Ok(()));
        std::fs::write(d.join("a.bin"), b"0123456788").unwrap();
        assert!(verify(d).unwrap_err().contains("checksum"));
        std::fs::write(d.join("a.bin"), b"012345678").unwrap();
        assert!(verify(d).unwrap_err().contains("9 bytes"));
        std::fs::remove_file(d.join("a.bin")).unwrap();
        assert!(verify(d).unwrap_err().contains("cannot be read"));
        std::fs::remove_file(d.join(MANIFEST_FILE)).unwrap();
        assert!(verify(d).unwrap_err().contains("manifest"));
    }
}
