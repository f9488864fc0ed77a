//! The GPU bench scripts' Python on the CPU (`benches/gpu/tests`, standard library only): the
//! Nsight Compute breakdown's kernel classes and per-step arithmetic on committed fixtures, the
//! GEMM shapes of a training step, and lib.sh's `bounded` (a stopped script stops its run).
//! Skipped, saying so, where there is no `python3`.

use std::path::Path;
use std::process::Command;

#[test]
fn the_gpu_breakdown_classifies_kernels_and_adds_up_without_a_gpu() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = match Command::new("python3")
        .current_dir(root)
        .args([
            "-B",
            "-m",
            "unittest",
            "discover",
            "-s",
            "benches/gpu/tests",
        ])
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("skipped: no `python3` to run benches/gpu/tests");
            return;
        }
        Err(e) => panic!("python3 runs: {e}"),
    };
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("\nOK") && !text.contains("Ran 0 tests"),
        "{text}"
    );
}
