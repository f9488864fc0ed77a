//! fp8 as a precision on the command line: `--precision fp8` trains with the blocks' matrix
//! products in fp8 (emulated on the CPU), and the search takes fp8 only where it can run and
//! pay, saying why it does not.

use crate::util::{assert_refused, autotune_in, stderr};

/// The losses of a metrics file, in step order.
fn losses(path: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            v["loss"].as_f64().unwrap()
        })
        .collect()
}

#[test]
fn training_in_fp8_learns_as_bf16_does_with_other_arithmetic() {
    let dir = tempfile::tempdir().unwrap();
    let train = |precision: &str| {
        let metrics = dir.path().join(format!("{precision}.jsonl"));
        let out = autotune_in(
            dir.path(),
            &[
                "train",
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--precision",
                precision,
                "--micro-batch",
                "8",
                "--steps",
                "40",
                "--seed",
                "5",
                "--metrics",
                metrics.to_str().unwrap(),
                "-q",
            ],
        );
        assert_eq!(out.status.code(), Some(0), "{precision}: {}", stderr(&out));
        losses(&metrics)
    };
    let (bf16, fp8) = (train("bf16"), train("fp8"));
    assert_eq!(fp8.len(), 40);
    assert_ne!(fp8, bf16, "the products ran in another arithmetic");
    let tail = |l: &[f64]| l[30..].iter().sum::<f64>() / 10.0;
    assert!(
        tail(&fp8) < 0.8 * fp8[0],
        "fp8 learns: {} -> {}",
        fp8[0],
        tail(&fp8)
    );
    assert!(
        (tail(&fp8) - tail(&bf16)).abs() <= 0.05 * tail(&bf16),
        "fp8 {} against bf16 {}",
        tail(&fp8),
        tail(&bf16)
    );
}

#[test]
fn fp8_is_refused_where_it_cannot_run_and_not_searched_where_it_cannot_pay() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // The autograd engines have no fp8 products.
    let train = [
        "train",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--precision",
        "fp8",
        "--engine",
        "fused",
        "--steps",
        "1",
        "-q",
    ];
    assert_refused(d, &train, "explicit engine");
    // A trial runner trains with its own products.
    for flag in [&["--allow-fp8"][..], &["--precision", "fp8"]] {
        let mut args = vec!["tune", "--model", "tiny", "--backend", "exec"];
        args.extend_from_slice(flag);
        args.extend(["--", "python3", "runner.py"]);
        assert_refused(d, &args, &flag.join(" "));
    }
    // A CPU target: asked by name, refused; allowed, not searched, and said why.
    let tune = [
        "tune",
        "--model",
        "tiny",
        "--target",
        "cpu",
        "--precision",
        "fp8",
    ];
    assert_refused(d, &tune, "CPU has no fp8 tensor cores");
    let out = autotune_in(
        d,
        &[
            "tune",
            "--model",
            "tiny",
            "--target",
            "cpu",
            "--allow-fp8",
            "--max-trials",
            "3",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("fp8 is not searched"),
        "{}",
        stderr(&out)
    );
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_ne!(plan["knobs"]["precision"], "fp8");
    assert!(plan.get("precision_note").is_none());
}
