use std::path::Path;
use std::process::{Command, Output};

use autotune::spec::model::ModelSpec;

/// The binary, with its token cache in the build's scratch folder rather than the user's, and
/// PyTorch's allocator setting left to autotune's default whatever the caller's is.
pub fn command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_autotune"));
    command
        .env(
            "XDG_CACHE_HOME",
            Path::new(env!("CARGO_TARGET_TMPDIR")).join("cache"),
        )
        .env_remove("PYTORCH_CUDA_ALLOC_CONF");
    command
}

/// Runs the `autotune` binary with `args`.
pub fn autotune(args: &[&str]) -> Output {
    command().args(args).output().expect("the test binary runs")
}

/// Runs the binary in `dir`.
pub fn autotune_in(dir: &Path, args: &[&str]) -> Output {
    command()
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

/// Runs the binary in `dir` with `args` and asserts it exits 2 with `needle` on stderr.
pub fn assert_refused(dir: &Path, args: &[&str], needle: &str) {
    let out = autotune_in(dir, args);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    assert!(stderr(&out).contains(needle), "{args:?}: {}", stderr(&out));
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

/// A Llama-shaped model (RMS norm, SwiGLU, rotary positions with Llama 3 scaling, 4 query heads
/// over 2 key/value heads, no biases, a tied head) for CPU tests; `qkv_bias` makes it Qwen 2's
/// shape.
pub fn small_llama(qkv_bias: bool) -> ModelSpec {
    let mut spec = ModelSpec::preset("llama-3.2-1b").unwrap();
    spec.name = "small-llama".into();
    spec.vocab_size = 97;
    spec.d_model = 64;
    spec.n_heads = 4;
    spec.n_kv_heads = Some(2);
    spec.n_layers = 2;
    spec.d_ff = 96;
    spec.seq_len = 16;
    spec.biases.qkv = qkv_bias;
    spec
}

/// Starts the binary in `dir`; its stderr lines arrive on the receiver as they are written.
pub fn spawn_in(
    dir: &Path,
    args: &[&str],
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead;
    let mut child = command()
        .current_dir(dir)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the test binary starts");
    let (tx, rx) = std::sync::mpsc::channel();
    let err = child.stderr.take().expect("stderr is piped");
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Reads lines until one contains `needle` (at most a minute); every line read so far.
pub fn read_until(rx: &std::sync::mpsc::Receiver<String>, needle: &str) -> Vec<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut seen = Vec::new();
    while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(line) => {
                let found = line.contains(needle);
                seen.push(line);
                if found {
                    return seen;
                }
            }
            Err(_) => break,
        }
    }
    panic!("no line with `{needle}` within a minute: {seen:#?}");
}

/// Sends `signal` (`-TERM`, `-HUP`, `-INT`) to process `pid`.
pub fn signal(pid: u32, signal: &str) {
    let ok = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(ok.success(), "kill {signal} {pid}");
}

/// The exit code of `child` once it ends (its stdout and stderr drained).
pub fn exit_code(child: std::process::Child) -> Option<i32> {
    child
        .wait_with_output()
        .expect("the child ends")
        .status
        .code()
}

/// A validator for one of the published JSON Schemas (`docs/NAME`), itself checked against its
/// draft's meta-schema.
pub fn published_schema(name: &str) -> jsonschema::Validator {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("docs")
        .join(name);
    let text = std::fs::read_to_string(&path).expect("the schema file is readable");
    let schema: serde_json::Value = serde_json::from_str(&text).expect("the schema is JSON");
    if let Err(e) = jsonschema::meta::validate(&schema) {
        panic!("{}: not a valid JSON Schema: {e}", path.display());
    }
    jsonschema::validator_for(&schema).expect("the schema compiles")
}

/// Why `instance` does not follow `schema` (empty when it does), one line per violation.
pub fn schema_violations(
    schema: &jsonschema::Validator,
    instance: &serde_json::Value,
) -> Vec<String> {
    schema
        .iter_errors(instance)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}
