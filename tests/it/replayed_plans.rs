//! Golden replays: every committed recording, replayed through the binary, gives exactly the
//! plan (or the no-plan answer) and the status lines stored under `tests/fixtures/replayed-plans/`.
//!
//! A replay is deterministic, so any change to the bytes is a change in what the search or the
//! plan does. What depends on the clock or the build is masked: the plan's `created_unix_s` and
//! its `provenance` (which carries the git revision).
//!
//! After an intended change, regenerate the expectations and review their diff:
//!
//! ```sh
//! AUTOTUNE_BLESS=1 cargo test --test it replayed_plans
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;

const RECORDED: &str = "profiles/recorded";
const EXPECTED: &str = "tests/fixtures/replayed-plans";
const MASK: &str = "\"<masked>\"";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.json` under `dir`, relative to `root`, sorted.
fn recordings(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(root.join(dir))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    entries.sort();
    for name in entries {
        let path = dir.join(name);
        if root.join(&path).is_dir() {
            recordings(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "json") {
            out.push(path);
        }
    }
}

/// The binary's stdout with the clock and the build masked: the top-level `created_unix_s`
/// value and the whole `provenance` object. Everything else is kept byte for byte.
fn masked(stdout: &str) -> String {
    let mut out = String::new();
    let mut in_provenance = false;
    for line in stdout.lines() {
        if in_provenance {
            if line == "  }" || line == "  }," {
                in_provenance = false;
                out.push_str(&format!("  \"provenance\": {MASK}{}\n", &line[3..]));
            }
            continue;
        }
        if line.starts_with("  \"created_unix_s\": ") {
            let comma = if line.ends_with(',') { "," } else { "" };
            out.push_str(&format!("  \"created_unix_s\": {MASK}{comma}\n"));
        } else if line == "  \"provenance\": {" {
            in_provenance = true;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Replays `recording` (relative to the repository) and returns its masked stdout, its stderr
/// and its exit code.
fn replay(recording: &Path) -> (String, String, Option<i32>) {
    let backend = format!("replay:{}", recording.display());
    let out = Command::new(env!("CARGO_BIN_EXE_autotune"))
        .current_dir(repo())
        .env_remove("RUST_LOG")
        .args(["tune", "--backend", &backend, "--json"])
        .output()
        .expect("the test binary runs");
    (
        masked(&String::from_utf8_lossy(&out.stdout)),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.code(),
    )
}

#[test]
fn every_recording_replays_to_its_stored_plan() {
    let bless = std::env::var_os("AUTOTUNE_BLESS").is_some_and(|v| v == "1");
    let mut found = Vec::new();
    recordings(repo(), Path::new(RECORDED), &mut found);
    assert!(found.len() >= 12, "recordings found: {found:?}");
    let mut differ = Vec::new();
    for recording in &found {
        let (stdout, stderr, code) = replay(recording);
        let inner = recording.strip_prefix(RECORDED).unwrap();
        let plan_file = repo().join(EXPECTED).join(inner);
        let stderr_file = plan_file.with_extension("stderr");
        let feasible = !stdout.contains("\"feasible\": false");
        assert_eq!(
            code,
            Some(if feasible { 0 } else { 1 }),
            "{}: {stderr}",
            recording.display()
        );
        if bless {
            std::fs::create_dir_all(plan_file.parent().unwrap()).unwrap();
            std::fs::write(&plan_file, &stdout).unwrap();
            std::fs::write(&stderr_file, &stderr).unwrap();
            continue;
        }
        let read = |file: &Path| {
            std::fs::read_to_string(file).unwrap_or_else(|e| {
                panic!(
                    "{}: {e}; run with AUTOTUNE_BLESS=1 to write it",
                    file.display()
                )
            })
        };
        if read(&plan_file) != stdout {
            differ.push(format!("{} (plan)", recording.display()));
        }
        if read(&stderr_file) != stderr {
            differ.push(format!("{} (status lines)", recording.display()));
        }
    }
    assert!(
        differ.is_empty(),
        "replays that changed (diff the output against {EXPECTED}; AUTOTUNE_BLESS=1 rewrites \
         it after an intended change): {differ:#?}"
    );
}

#[test]
fn masking_keeps_everything_but_the_clock_and_the_build() {
    let plan = "{\n  \"schema_version\": 1,\n  \"created_unix_s\": 17,\n  \"knobs\": {\n    \
                \"micro_batch\": 4\n  },\n  \"provenance\": {\n    \"git_revision\": \"abc\"\n  \
                }\n}\n";
    assert_eq!(
        masked(plan),
        format!(
            "{{\n  \"schema_version\": 1,\n  \"created_unix_s\": {MASK},\n  \"knobs\": {{\n    \
             \"micro_batch\": 4\n  }},\n  \"provenance\": {MASK}\n}}\n"
        )
    );
}
