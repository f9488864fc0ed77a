//! One policy for every file a command writes: a new path or a regular file, never a device,
//! a FIFO, a directory or a link's target; never one of the command's own inputs; never two
//! outputs on one path. Checked before the work, so that nothing is lost to a typo after it.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Refuses `outputs` (each with the flag that named it) that break the policy against each other
/// and against `inputs` (each with its flag); errors name the flags.
pub fn check_outputs(outputs: &[(&str, &Path)], inputs: &[(&str, &Path)]) -> Result<()> {
    for (i, &(flag, path)) in outputs.iter().enumerate() {
        check_target(flag, path)?;
        let id = identity(path);
        if let Some((other, _)) = outputs[..i].iter().find(|(_, p)| identity(p) == id) {
            return Err(refused(
                flag,
                path,
                format!("is also {other}'s output; one of the two would be lost: give each its own file"),
            ));
        }
        if let Some((input, _)) = inputs.iter().find(|(_, p)| identity(p) == id) {
            return Err(refused(
                flag,
                path,
                format!("is the file {input} reads, which writing would destroy: write elsewhere"),
            ));
        }
    }
    Ok(())
}

/// Refuses `folder` (named by `flag`), a folder a command writes its files into, where it is one
/// of `inputs` (each with its flag: a folder, or a file standing for the folder it is in) or
/// lies inside one: the files written would replace or mix with what the command reads, such
/// as a checkpoint directory that a later resume or prune treats as its own.
pub fn check_output_folder(flag: &str, folder: &Path, inputs: &[(&str, &Path)]) -> Result<()> {
    if std::fs::metadata(folder).is_ok_and(|m| !m.is_dir()) {
        return Err(refused(flag, folder, "is a file; name a folder".into()));
    }
    let id = identity(folder);
    for &(input, path) in inputs {
        let input_id = if path.is_dir() {
            identity(path)
        } else {
            identity(parent_dir(path))
        };
        if id.starts_with(&input_id) {
            return Err(refused(
                flag,
                folder,
                format!(
                    "lies in `{}`, which {input} reads; the files written there would mix with \
                     it: write to a folder outside it",
                    input_id.display()
                ),
            ));
        }
    }
    Ok(())
}

/// Where an output named `path` (by `flag`) is written when links are followed
/// (`--follow-symlinks`): the file a symbolic link finally points to, so that the link stays a
/// link and its target is replaced; any other path as it is. A link to nothing is refused: there
/// is no file to write through it that the user could have meant.
pub fn follow_link(flag: &str, path: &Path) -> Result<PathBuf> {
    let is_link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    if !is_link {
        return Ok(path.to_path_buf());
    }
    std::fs::canonicalize(path).map_err(|e| {
        refused(
            flag,
            path,
            format!("is a symbolic link to nothing that can be opened ({e}); name a file"),
        )
    })
}

/// A path that exists must be a regular file: anything else (a device, a FIFO, a socket, a
/// directory) would be replaced by one, or written into, and a link's target is not what the
/// user named.
fn check_target(flag: &str, path: &Path) -> Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    let kind = meta.file_type();
    let problem = if kind.is_symlink() {
        "is a symbolic link; name the file it points to, a new path, or pass --follow-symlinks \
         to write the file it points to"
    } else if kind.is_dir() {
        "is a directory; name a file in it"
    } else if !kind.is_file() {
        "is not a regular file (a device, a FIFO or a socket); autotune writes only regular files"
    } else {
        return Ok(());
    };
    Err(refused(flag, path, problem.into()))
}

/// Where `path` is: its nearest existing ancestor resolved (links, `..`) and the names below
/// it, whether or not the file or its folders exist yet.
fn identity(path: &Path) -> PathBuf {
    if let Ok(real) = path.canonicalize() {
        return real;
    }
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut missing = Vec::new();
    let mut existing = absolute.as_path();
    while let (Some(parent), Some(name)) = (existing.parent(), existing.file_name()) {
        missing.push(name);
        if let Ok(real) = parent.canonicalize() {
            return missing.iter().rev().fold(real, |p, name| p.join(name));
        }
        existing = parent;
    }
    absolute
}

/// The folder `path` is in (`.` for a bare name).
pub fn parent_dir(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

fn refused(flag: &str, path: &Path, problem: String) -> Error {
    Error::InvalidFlag {
        flag: format!("{flag} {}", path.display()),
        problem,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_never_clobber_inputs_each_other_or_what_is_not_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("d.bin");
        std::fs::write(&data, b"tokens").unwrap();
        let plan = dir.path().join("p.json");
        let report = dir.path().join("r.html");
        assert!(check_outputs(
            &[("--out", &plan), ("--report", &report)],
            &[("--data", &data)]
        )
        .is_ok());
        // The same file by another spelling.
        let again = dir.path().join(".").join("p.json");
        let err = check_outputs(&[("--out", &plan), ("--report", &again)], &[]).unwrap_err();
        assert!(err.to_string().contains("--out's output"), "{err}");
        let err = check_outputs(&[("--metrics", &data)], &[("--data", &data)]).unwrap_err();
        assert!(err.to_string().contains("the file --data reads"), "{err}");
        let err = check_outputs(&[("--out", dir.path())], &[]).unwrap_err();
        assert!(err.to_string().contains("directory"), "{err}");
        let err = check_outputs(&[("--out", Path::new("/dev/null"))], &[]).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        #[cfg(unix)]
        {
            let link = dir.path().join("link.json");
            std::os::unix::fs::symlink(&data, &link).unwrap();
            let err = check_outputs(&[("--out", &link)], &[]).unwrap_err();
            assert!(err.to_string().contains("symbolic link"), "{err}");
        }
        // A regular file that is no input is replaced, as asked.
        assert!(check_outputs(&[("--out", &data)], &[]).is_ok());
    }

    #[test]
    fn an_output_folder_never_lies_in_an_input() {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("ck");
        std::fs::create_dir(&ck).unwrap();
        let tokenizer = dir.path().join("model").join("tokenizer.json");
        let inputs = [("--checkpoint", ck.as_path()), ("--tokenizer", &tokenizer)];
        let beside = dir.path().join("export");
        assert!(check_output_folder("--out", &beside, &inputs).is_ok());
        for inside in [
            ck.clone(),
            ck.join("step-000001"),
            ck.join("new").join("deeper"),
            dir.path().join("model"),
            ck.join("..").join("ck").join("y"),
        ] {
            let err = check_output_folder("--out", &inside, &inputs).unwrap_err();
            assert!(
                err.to_string().contains("which --"),
                "{}: {err}",
                inside.display()
            );
        }
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let err = check_output_folder("--out", &file, &[]).unwrap_err();
        assert!(err.to_string().contains("name a folder"), "{err}");
    }

    #[test]
    fn a_followed_link_is_its_target_and_a_link_to_nothing_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("plan.json");
        std::fs::write(&target, b"{}").unwrap();
        let link = dir.path().join("latest.json");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert_eq!(
            follow_link("--out", &link).unwrap(),
            std::fs::canonicalize(&target).unwrap()
        );
        let fresh = dir.path().join("new.json");
        assert_eq!(follow_link("--out", &fresh).unwrap(), fresh);
        // Without following, the link itself is refused, and the message names the flag.
        let err = check_outputs(&[("--out", &link)], &[]).unwrap_err();
        assert!(err.to_string().contains("--follow-symlinks"), "{err}");
        let dangling = dir.path().join("dangling.json");
        std::os::unix::fs::symlink(dir.path().join("gone/x.json"), &dangling).unwrap();
        let err = follow_link("--out", &dangling).unwrap_err();
        assert!(err.to_string().contains("--out"), "{err}");
    }
}
