//! Compiles the fused-op CUDA kernels (`src/ops/kernels/*.cu`) to PTX when the `cuda` feature
//! is on; does nothing otherwise, so CPU builds need no CUDA toolkit.
//!
//! The PTX targets `compute_80` (virtual architecture, no SASS): the driver JIT-compiles it for
//! whatever GPU runs it (sm_86, sm_89, sm_90, ...). Arch-specific targets such as `sm_90a` are
//! avoided on purpose because their PTX loads on exactly one chip.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const KERNEL_DIR: &str = "src/ops/kernels";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=NVCC");
    git_revision();
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = env::var_os("NVCC").unwrap_or_else(|| "nvcc".into());

    let mut sources = Vec::new();
    let mut headers = Vec::new();
    for entry in std::fs::read_dir(KERNEL_DIR).expect("src/ops/kernels exists") {
        let path = entry.expect("readable kernel directory").path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("cu") => sources.push(path),
            Some("cuh") => headers.push(path),
            _ => {}
        }
    }
    sources.sort();
    // A header change must rebuild every kernel that includes it.
    for path in sources.iter().chain(&headers) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    println!("cargo:rerun-if-changed={KERNEL_DIR}");

    for src in &sources {
        compile(&nvcc, src, &out_dir);
    }
}

fn compile(nvcc: &std::ffi::OsStr, src: &Path, out_dir: &Path) {
    let stem = src.file_stem().expect("kernel file name");
    let ptx = out_dir.join(stem).with_extension("ptx");
    let status = Command::new(nvcc)
        .arg("--ptx")
        .arg("-arch=compute_80")
        .arg("-O3")
        .arg("-std=c++17")
        .arg("-I")
        .arg(KERNEL_DIR)
        .arg("-o")
        .arg(&ptx)
        .arg(src)
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run nvcc ({}): {e}; set NVCC to the nvcc binary",
                nvcc.to_string_lossy()
            )
        });
    assert!(status.success(), "nvcc failed on {}", src.display());
}

/// Sets `AUTOTUNE_GIT_REVISION` to the checkout's commit, for plans' provenance; leaves it unset
/// outside a git checkout (a source tarball) or without git.
fn git_revision() {
    // HEAD, and the branch it names (which a commit moves); not the index, whose every
    // change would rerun this script and its CUDA compilation.
    let mut watched = vec![".git/HEAD".to_string()];
    if let Ok(head) = std::fs::read_to_string(".git/HEAD") {
        if let Some(branch) = head.trim().strip_prefix("ref: ") {
            watched.push(format!(".git/{branch}"));
        }
    }
    for path in watched.iter().filter(|p| Path::new(p).exists()) {
        println!("cargo:rerun-if-changed={path}");
    }
    let out = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output();
    if let Ok(out) = out {
        let rev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !rev.is_empty() {
            println!("cargo:rustc-env=AUTOTUNE_GIT_REVISION={rev}");
        }
    }
}
