//! Which files a checkpoint's weights are read from: `model.safetensors`, or the shards a
//! `model.safetensors.index.json` lists, or a single file given directly; each resolved inside
//! the model's folder.
//!
//! A shard that is a symbolic link to a file elsewhere, or an index entry that climbs out of
//! the folder, would read weights the user never named as the model's. The Hugging Face hub's
//! cache is the one layout that links out on purpose: a snapshot's files link to its
//! repository's `blobs` folder, which counts as inside.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::safetensors::bad;
use crate::{Error, Result};

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";

/// The safetensors files of the checkpoint at `path` (a folder, or one file).
pub fn of(path: &Path) -> Result<Vec<PathBuf>> {
    // `exists`, not `is_file`: the reader says what is wrong with one that is no regular file,
    // where skipping it would report a folder without weights.
    if path.exists() && !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let names = if path.join(INDEX).exists() {
        shard_names(path)?
    } else if path.join(SINGLE).exists() {
        vec![SINGLE.to_string()]
    } else {
        return Err(bad(
            path,
            "holds neither model.safetensors nor model.safetensors.index.json; give the folder \
             `save_pretrained` wrote",
        ));
    };
    let roots = roots(path)?;
    names
        .iter()
        .map(|name| resolved_inside(path, &roots, name))
        .collect()
}

/// The shard names the index's `weight_map` lists, each once, sorted.
fn shard_names(dir: &Path) -> Result<Vec<String>> {
    let index_path = dir.join(INDEX);
    let text = crate::input_file::read_to_string(&index_path, crate::input_file::DOCUMENT_LIMIT)
        .map_err(|e| Error::file("cannot read", &index_path, e))?;
    let index = autotune_core::json::parse_value("safetensors index", &text)
        .map_err(|e| bad(&index_path, e.to_string()))?;
    let map = index
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad(&index_path, "has no `weight_map` object"))?;
    let mut files = Vec::with_capacity(map.len());
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| {
            bad(
                &index_path,
                format!("maps tensor `{tensor}` to {file}, not to a file name"),
            )
        })?;
        // Shards sit beside the index: a name with a folder in it is refused.
        if Path::new(file).components().count() != 1 {
            return Err(bad(
                &index_path,
                format!("names shard `{file}` outside its folder"),
            ));
        }
        files.push(file.to_string());
    }
    files.sort();
    files.dedup();
    if files.is_empty() {
        return Err(bad(&index_path, "lists no shard files in `weight_map`"));
    }
    Ok(files)
}

/// The folders a checkpoint's files may resolve into: its own, and for a hub cache snapshot
/// (`models--org--name/snapshots/REVISION`) its repository's `blobs`.
fn roots(dir: &Path) -> Result<Vec<PathBuf>> {
    let own = dir
        .canonicalize()
        .map_err(|e| Error::file("cannot resolve", dir, e))?;
    let mut roots = vec![own.clone()];
    let snapshots = own.parent().filter(|p| p.ends_with("snapshots"));
    if let Some(repository) = snapshots.and_then(Path::parent) {
        roots.push(repository.join("blobs"));
    }
    Ok(roots)
}

/// `dir`'s file `name`, its links followed, refused unless it lies under one of `roots`.
fn resolved_inside(dir: &Path, roots: &[PathBuf], name: &str) -> Result<PathBuf> {
    let path = dir.join(name);
    let resolved = path
        .canonicalize()
        .map_err(|e| Error::file("cannot open", &path, e))?;
    if roots.iter().any(|root| resolved.starts_with(root)) {
        // The name as the folder has it, which messages about the file then show.
        return Ok(path);
    }
    Err(bad(
        &path,
        format!(
            "resolves to `{}`, outside the model folder `{}`; a checkpoint's weights must be \
             its own: copy the file into the folder",
            resolved.display(),
            roots[0].display()
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(target: &Path, at: &Path) {
        std::os::unix::fs::symlink(target, at).unwrap();
    }

    #[test]
    fn files_are_resolved_inside_the_folder_or_its_hub_cache_blobs() {
        let tmp = tempfile::tempdir().unwrap();
        let snapshot = tmp.path().join("models--org--m/snapshots/abc");
        let blobs = tmp.path().join("models--org--m/blobs");
        let elsewhere = tmp.path().join("elsewhere");
        for d in [&snapshot, &blobs, &elsewhere] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(blobs.join("sha"), b"x").unwrap();
        std::fs::write(elsewhere.join("w"), b"x").unwrap();
        link(&blobs.join("sha"), &snapshot.join(SINGLE));
        assert_eq!(of(&snapshot).unwrap(), vec![snapshot.join(SINGLE)]);
        let plain = tmp.path().join("plain");
        std::fs::create_dir_all(&plain).unwrap();
        link(&elsewhere.join("w"), &plain.join(SINGLE));
        let message = of(&plain).unwrap_err().to_string();
        assert!(message.contains("outside the model folder"), "{message}");
    }
}
