//! Token files are read a window at a time: a large corpus costs the training process only the pages its
//! batches touch, not a copy of the file.

use std::io::Write;
use std::path::Path;

use crate::util::{autotune_in, exit_code, read_until, signal, spawn_in, stderr};

/// The process's peak resident memory so far (`VmHWM`), bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("a VmHWM line");
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// Writes `tokens` u16 ids below 256 (the tiny model's vocabulary), a megabyte at a time.
pub(crate) fn token_file(path: &Path, tokens: usize) {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let block: Vec<u8> = (0..1 << 19)
        .flat_map(|i: u32| (((i * 31 + i / 7) % 256) as u16).to_le_bytes())
        .collect();
    let mut left = tokens;
    while left > 0 {
        let n = left.min(block.len() / 2);
        out.write_all(&block[..2 * n]).unwrap();
        left -= n;
    }
    out.flush().unwrap();
}

/// Cuts the file at `path` to nothing in place, as a run reading it would meet it.
pub(crate) fn empty_in_place(path: &Path) {
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.set_len(0).unwrap();
}

/// The peak resident memory of `train` on `data` after 40 steps of the tiny model.
fn peak_rss_training_on(dir: &Path, data: &str) -> u64 {
    let (child, lines) = spawn_in(
        dir,
        &[
            "train",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--micro-batch",
            "8",
            "--steps",
            "200",
            "--data",
            data,
        ],
    );
    read_until(&lines, "step 40:");
    let peak = peak_rss(child.id());
    signal(child.id(), "-KILL");
    exit_code(child);
    peak
}

#[test]
fn a_200_mb_token_file_trains_in_far_less_memory_than_its_size() {
    let dir = tempfile::tempdir().unwrap();
    token_file(&dir.path().join("small.bin"), 100_000);
    token_file(&dir.path().join("large.bin"), 100_000_000);
    let large_bytes = std::fs::metadata(dir.path().join("large.bin"))
        .unwrap()
        .len();
    assert_eq!(large_bytes, 200_000_000);
    let small = peak_rss_training_on(dir.path(), "small.bin");
    let large = peak_rss_training_on(dir.path(), "large.bin");
    eprintln!("peak RSS: {small} bytes on 200 kB of tokens, {large} on 200 MB");
    assert!(
        large < small + 100_000_000,
        "training on the 200 MB file peaked at {large} bytes, {} over the small file's {small}",
        large.saturating_sub(small)
    );
}

#[test]
fn a_token_file_cut_short_under_a_run_ends_it_with_a_checkpoint_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("tokens.bin");
    token_file(&data, 100_000);
    let whole = std::fs::read(&data).unwrap();
    let run = [
        "train",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--micro-batch",
        "2",
        "--data",
        "tokens.bin",
        "--checkpoint-dir",
        "ck",
        "--checkpoint-every",
        "1000000",
    ];
    let (child, lines) = spawn_in(dir.path(), &[&run[..], &["--steps", "1000000"]].concat());
    read_until(&lines, "step 1:");
    // Emptied: whichever window the next step reads now lies past the end.
    empty_in_place(&data);
    let said = read_until(&lines, "error:").join("\n");
    let said = [said, lines.iter().collect::<Vec<_>>().join("\n")].join("\n");
    assert_eq!(exit_code(child), Some(2), "{said}");
    assert!(
        said.contains("tokens.bin") && said.contains("changed while the run read it"),
        "{said}"
    );
    let ck = dir.path().join("ck");
    let name = std::fs::read_to_string(ck.join("latest")).expect("a checkpoint was saved");
    assert!(
        said.contains(name.trim()),
        "the error names the checkpoint: {said}"
    );
    autotune::train::checkpoint::verify(&ck.join(name.trim())).unwrap();
    // With the file restored, the run resumes from that checkpoint.
    std::fs::write(&data, whole).unwrap();
    let step: u64 = name.trim()["step-".len()..].parse().unwrap();
    let steps = (step + 1).to_string();
    let out = autotune_in(
        dir.path(),
        &[&run[..], &["--steps", &steps, "--resume"]].concat(),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}
