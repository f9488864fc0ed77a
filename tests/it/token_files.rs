//! Token files are memory-mapped: a large corpus costs the training process only the pages its
//! batches touch, not a copy of the file.

use std::io::Write;
use std::path::Path;

use crate::util::{exit_code, read_until, signal, spawn_in};

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
fn token_file(path: &Path, tokens: usize) {
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
