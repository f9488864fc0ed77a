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

    /// Reads `dir`'s manifest: one entry for every file a checkpoint holds, each a plain name
    /// inside the checkpoint, none twice.
    pub fn read(dir: &Path) -> std::result::Result<Self, String> {
        let path = dir.join(MANIFEST_FILE);
        let text = crate::input_file::read_to_string(&path, crate::input_file::DOCUMENT_LIMIT)
            .map_err(|e| format!("its manifest `{}` cannot be read ({e})", path.display()))?;
        let manifest: Self = autotune_core::json::from_str("checkpoint manifest", &text)
            .map_err(|e| format!("its manifest `{}` is not one ({e})", path.display()))?;
        manifest
            .check_names()
            .map_err(|problem| format!("its manifest `{}`: {problem}", path.display()))?;
        Ok(manifest)
    }

    /// Whether the entries name exactly the files a checkpoint holds: a manifest that leaves
    /// one out would let it pass unchecked, and a name that is a path (absolute, `..`, a
    /// folder) would check a file outside the checkpoint, or read a device.
    fn check_names(&self) -> std::result::Result<(), String> {
        for (i, file) in self.files.iter().enumerate() {
            let plain = !file.name.is_empty()
                && file.name != "."
                && file.name != ".."
                && !file.name.contains(['/', '\\', '\0']);
            if !plain {
                return Err(format!(
                    "field `files[{i}].name` (`{}`) is not the name of a file in the checkpoint; \
                     a manifest names its checkpoint's files by their plain names",
                    file.name
                ));
            }
            if self.files[..i].iter().any(|f| f.name == file.name) {
                return Err(format!(
                    "field `files[{i}].name` lists `{}` a second time",
                    file.name
                ));
            }
            if !super::FILES.contains(&file.name.as_str()) {
                return Err(format!(
                    "field `files[{i}].name` names `{}`, which is no file of a checkpoint ({})",
                    file.name,
                    super::FILES.join(", ")
                ));
            }
        }
        match super::FILES
            .iter()
            .find(|name| !self.files.iter().any(|f| f.name == **name))
        {
            Some(missing) => Err(format!(
                "field `files` does not list `{missing}`, which every checkpoint holds"
            )),
            None => Ok(()),
        }
    }

    /// What is wrong with `dir`'s files against this manifest, if anything.
    pub fn damage(&self, dir: &Path) -> Option<String> {
        for file in &self.files {
            let path = dir.join(&file.name);
            // A link could lead the check to a file elsewhere, or to a device.
            if std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
                return Some(format!(
                    "`{}` is a symbolic link; a checkpoint holds its files themselves",
                    file.name
                ));
            }
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
    let mut file = crate::input_file::open(path)?;
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

    /// A checkpoint's files with short contents, and their manifest.
    fn sealed(d: &Path) {
        for (i, name) in super::super::FILES.iter().enumerate() {
            std::fs::write(d.join(name), format!("{i}123456789")).unwrap();
        }
        Manifest::of(d, &super::super::FILES)
            .unwrap()
            .write(d)
            .unwrap();
    }

    #[test]
    fn a_flipped_byte_a_truncation_or_a_missing_file_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        sealed(d);
        assert_eq!(verify(d), Ok(()));
        let a = d.join(super::super::FILES[0]);
        std::fs::write(&a, b"0123456788").unwrap();
        assert!(verify(d).unwrap_err().contains("checksum"));
        std::fs::write(&a, b"012345678").unwrap();
        assert!(verify(d).unwrap_err().contains("9 bytes"));
        std::fs::remove_file(&a).unwrap();
        assert!(verify(d).unwrap_err().contains("cannot be read"));
        std::os::unix::fs::symlink("/dev/zero", &a).unwrap();
        assert!(verify(d).unwrap_err().contains("symbolic link"));
        std::fs::remove_file(d.join(MANIFEST_FILE)).unwrap();
        assert!(verify(d).unwrap_err().contains("manifest"));
    }

    #[test]
    fn a_manifest_names_every_file_of_the_checkpoint_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        sealed(d);
        let manifest = Manifest::read(d).unwrap();
        let with = |edit: &dyn Fn(&mut Manifest)| {
            let mut m = manifest.clone();
            edit(&mut m);
            m.write(d).unwrap();
            verify(d).unwrap_err()
        };
        assert!(with(&|m| m.files.clear()).contains("does not list `model.safetensors`"));
        assert!(with(&|m| m.files.truncate(2)).contains("does not list `state.json`"));
        for bad in ["/dev/zero", "../state.json", "sub/state.json", "..", ""] {
            let err = with(&|m| m.files[0].name = bad.into());
            assert!(err.contains("files[0].name"), "{bad}: {err}");
        }
        let err = with(&|m| m.files[1].name = m.files[0].name.clone());
        assert!(err.contains("a second time"), "{err}");
        let err = with(&|m| m.files[0].name = "extra.bin".into());
        assert!(err.contains("no file of a checkpoint"), "{err}");
    }
}
