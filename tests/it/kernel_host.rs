//! GPU kernels compiled for the host: the fp8 conversion kernels (`src/ops/kernels/fp8.cu`)
//! run block by block on host threads (a barrier where they call `__syncthreads`) against a
//! plain definition of the codes, so that CI, which has no GPU, holds their indexing, packing
//! and edge handling. The harness is `tests/fixtures/kernels/fp8_host.cpp`. Skipped, saying so,
//! where there is no C++ compiler.

use std::path::Path;
use std::process::Command;

/// The part of `source` from the line that starts with `from` up to the line that starts with
/// `to`; panics naming the marker that is missing, since a renamed kernel must rename it here.
fn cut<'a>(source: &'a str, from: &str, to: &str) -> &'a str {
    let start = source
        .find(from)
        .unwrap_or_else(|| panic!("fp8.cu has no `{from}`"));
    let end = source[start..]
        .find(to)
        .unwrap_or_else(|| panic!("fp8.cu has no `{to}` after `{from}`"));
    &source[start..start + end]
}

#[test]
fn the_fp8_conversion_kernels_run_on_the_host_give_the_defined_codes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let source = std::fs::read_to_string(root.join("src/ops/kernels/fp8.cu")).unwrap();
    let kernels = [
        cut(
            &source,
            "__device__ __forceinline__ unsigned char fp8_encode(",
            "__device__ __forceinline__ float warp_max",
        ),
        cut(
            &source,
            "// Eight values' codes at scale `s`",
            "#define FP8_KERNELS",
        ),
    ]
    .concat();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("fp8_kernels.inc"), kernels).unwrap();
    let binary = dir.path().join("fp8_host");
    let built = match Command::new("c++")
        .args(["-std=c++20", "-O1", "-pthread", "-I"])
        .arg(dir.path())
        .arg(root.join("tests/fixtures/kernels/fp8_host.cpp"))
        .arg("-o")
        .arg(&binary)
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("skipped: no `c++` to build tests/fixtures/kernels/fp8_host.cpp");
            return;
        }
        Err(e) => panic!("c++ runs: {e}"),
    };
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let run = Command::new(&binary).output().unwrap();
    let text = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{text}");
    assert!(text.contains("fp8 kernels match on every shape"), "{text}");
}
