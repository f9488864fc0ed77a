use std::path::Path;
use std::process::{Command, Output};

use autotune::spec::model::ModelSpec;

/// Runs the `autotune` binary with `args`.
pub fn autotune(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_autotune"))
        .args(args)
        .output()
        .expect("the test binary runs")
}

/// Runs the binary in `dir`.
pub fn autotune_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_autotune"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("the test binary runs")
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A seed-shaped model (post-norm, ReLU, dropout, no positions, Adam) small enough for CPU tests.
pub fn small_seed(dropout: f32) -> ModelSpec {
    ModelSpec {
        name: "small-seed".into(),
        vocab_size: 97,
        d_model: 32,
        n_heads: 4,
        n_layers: 2,
        d_ff: 64,
        seq_len: 16,
        dropout,
        ..ModelSpec::seed()
    }
}

/// A GPT-shaped model (pre-norm, GELU, causal, learned positions, AdamW) for CPU tests.
pub fn small_gpt() -> ModelSpec {
    ModelSpec {
        name: "small-gpt".into(),
        vocab_size: 97,
        seq_len: 16,
        d_model: 32,
        d_ff: 64,
        ..ModelSpec::tiny()
    }
}
