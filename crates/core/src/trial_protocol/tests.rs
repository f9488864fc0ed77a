use super::*;
use crate::knobs::{Checkpointing, Offload, Precision};

fn knobs(micro_batch: usize) -> Knobs {
    Knobs {
        grad_accum: 2,
        checkpointing: Checkpointing::EveryKth(1),
        ..Knobs::new(micro_batch, Precision::Bf16)
    }
}

/// The id of the request the replies of these tests answer.
const ID: u64 = 7;

fn reply(line: &str) -> RunnerReply {
    match parse_reply_line(line, ID) {
        Some(Ok(reply)) => reply,
        Some(Err(e)) => panic!("{line}: {e:?}"),
        None => panic!("{line}: not taken for a reply"),
    }
}

/// The field an invalid reply names.
fn invalid_field(line: &str) -> String {
    match parse_reply_line(line, ID) {
        Some(Err(BadReply::Invalid(Error::InvalidSpec { field, .. }))) => field,
        other => panic!("{line}: expected an invalid reply, got {other:?}"),
    }
}

#[test]
fn a_request_carries_the_version_the_knobs_the_model_and_the_limits() {
    let trial = TrialRequest {
        knobs: knobs(8),
        warmup_steps: 1,
        timed_steps: 3,
        remeasure: false,
    };
    let request = RunnerRequest::new(
        ID,
        &ModelSpec::tiny(),
        &trial,
        DeviceKind::Cuda,
        Some(25_757_220_864),
        Some(1 << 35),
    );
    let line = request.to_line();
    assert!(!line.contains('\n'));
    let value: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(value["protocol"], 1, "runners of version 1 read it");
    assert_eq!(value["id"], ID);
    assert_eq!(value["model"]["name"], "tiny");
    assert_eq!(value["model"]["seq_len"], 64);
    assert_eq!(value["knobs"]["micro_batch"], 8);
    assert_eq!(value["knobs"]["grad_accum"], 2);
    assert_eq!(value["knobs"]["precision"], "bf16");
    assert_eq!(
        value["knobs"]["checkpointing"],
        serde_json::json!({"mode": "every_kth", "k": 1})
    );
    assert_eq!(value["knobs"]["offload"], "none");
    assert_eq!(value["device"], "cuda");
    assert_eq!(value["gpu_capacity_bytes"], 25_757_220_864u64);
    assert_eq!(value["host_budget_bytes"], 1u64 << 35);
    assert_eq!(
        (value["warmup_steps"].clone(), value["timed_steps"].clone()),
        (1.into(), 3.into())
    );
    let back: RunnerRequest = serde_json::from_str(&line).unwrap();
    assert_eq!(back, request);
}

#[test]
fn a_fit_is_measured_from_its_step_times_as_autotunes_own_trials_are() {
    let r = reply(
        r#"{"protocol": 1, "outcome": "fits", "engine": "pytorch", "engine_version": "2.11.0",
            "device": "NVIDIA H200", "reusable": true, "step_times_s": [0.3, 0.1, 0.2],
            "peak_gpu_bytes": 1000, "peak_host_bytes": 2000}"#,
    );
    assert_eq!(
        r.identity,
        RunnerIdentity {
            engine: "pytorch".into(),
            engine_version: Some("2.11.0".into()),
            device: Some("NVIDIA H200".into()),
        }
    );
    assert!(r.reusable);
    let Outcome::Fits(m) = r.outcome(&knobs(8), 64).unwrap() else {
        panic!("a fit");
    };
    assert_eq!(
        (m.peak_gpu_bytes, m.peak_host_bytes, m.timed_steps),
        (1000, 2000, 3)
    );
    assert!((m.step_time_median_s - 0.2).abs() < 1e-12);
    // (p90 − p10) / median over 0.1, 0.2, 0.3: (0.28 − 0.12) / 0.2.
    assert!(
        (m.step_time_spread - 0.8).abs() < 1e-9,
        "{}",
        m.step_time_spread
    );
    // 8 sequences × 2 micro-batches × 64 tokens in 0.2 s.
    assert!((m.tokens_per_s - 5120.0).abs() < 1e-6);
    assert_eq!(m.host_link, None);

    let own = reply(
        r#"{"protocol": 1, "outcome": "fits", "engine": "jax", "step_times_s": [1.0],
            "peak_gpu_bytes": 0, "peak_host_bytes": 0, "tokens_per_s": 42.5}"#,
    );
    assert!(
        !own.reusable,
        "a runner serves one trial unless it says otherwise"
    );
    assert_eq!(own.identity.engine_version, None);
    let Outcome::Fits(m) = own.outcome(&knobs(8), 64).unwrap() else {
        panic!("a fit");
    };
    assert_eq!(m.tokens_per_s, 42.5, "the runner's own count wins");
}

#[test]
fn out_of_memory_errors_and_unsupported_regimes_are_outcomes() {
    let oom = reply(
        r#"{"protocol": 1, "outcome": "out_of_memory", "engine": "pytorch", "memory": "gpu"}"#,
    );
    assert_eq!(
        oom.outcome(&knobs(8), 64).unwrap(),
        Outcome::OutOfMemory {
            memory: MemoryKind::Gpu,
            phase: Phase::ForwardBackward
        }
    );
    let host = reply(
        r#"{"protocol": 1, "outcome": "out_of_memory", "engine": "pytorch", "memory": "host",
            "phase": "optimizer_step"}"#,
    );
    assert_eq!(
        host.outcome(&knobs(8), 64).unwrap(),
        Outcome::OutOfMemory {
            memory: MemoryKind::Host,
            phase: Phase::OptimizerStep
        }
    );
    let error = reply(
        r#"{"protocol": 1, "outcome": "error", "engine": "pytorch", "reason": "bad\nbatch"}"#,
    );
    assert_eq!(
        error.outcome(&knobs(8), 64).unwrap(),
        Outcome::Crashed {
            reason: "trial runner: bad batch".into()
        }
    );
    let unsupported = reply(
        r#"{"protocol": 1, "outcome": "unsupported", "engine": "pytorch",
            "reason": "deepspeed is not installed"}"#,
    );
    let offloaded = Knobs {
        offload: Offload::Optimizer,
        ..knobs(4)
    };
    let Outcome::Crashed { reason } = unsupported.outcome(&offloaded, 64).unwrap() else {
        panic!("unsupported is infeasible");
    };
    assert!(reason.contains("offload=optimizer"), "{reason}");
    assert!(reason.contains("deepspeed is not installed"), "{reason}");
}

#[test]
fn only_json_objects_with_a_protocol_key_are_replies() {
    for line in [
        "",
        "loss 3.2",
        "[1, 2]",
        "{not json",
        r#"{"outcome": "fits"}"#,
        r#"{"step": 3, "loss": 2.5}"#,
        "\u{0}\u{1}binary",
    ] {
        assert!(parse_reply_line(line, ID).is_none(), "{line:?}");
    }
}

#[test]
fn another_protocol_version_is_told_apart_from_a_bad_reply() {
    for (line, found) in [
        (r#"{"protocol": 3, "id": 7, "outcome": "fits"}"#, "3"),
        (r#"{"protocol": "1", "outcome": "fits"}"#, "\"1\""),
        (r#"{"protocol": null}"#, "null"),
    ] {
        match parse_reply_line(line, ID) {
            Some(Err(BadReply::Version(v))) => assert_eq!(v, found),
            other => panic!("{line}: {other:?}"),
        }
    }
}

#[test]
fn invalid_replies_name_the_field() {
    let fits = |extra: &str| {
        format!(
            r#"{{"protocol": 1, "outcome": "fits", "engine": "pytorch", "peak_gpu_bytes": 1,
                "peak_host_bytes": 1{extra}}}"#
        )
    };
    assert_eq!(invalid_field(&fits("")), "step_times_s");
    assert_eq!(
        invalid_field(&fits(r#", "step_times_s": [0.1, 0.0]"#)),
        "step_times_s[1]"
    );
    assert_eq!(
        invalid_field(&fits(r#", "step_times_s": []"#)),
        "step_times_s",
        "a fit without a step time is no measurement"
    );
    assert_eq!(
        invalid_field(&fits(r#", "step_times_s": [0.1, 1e-300]"#)),
        "step_times_s[1]",
        "below the physical floor"
    );
    assert_eq!(
        invalid_field(&fits(r#", "step_times_s": [0.1], "tokens_per_s": 1e12"#)),
        "tokens_per_s"
    );
    assert_eq!(
        invalid_field(&fits(r#", "step_times_s": [1e7]"#)),
        "step_times_s[0]"
    );
    assert_eq!(
        invalid_field(&fits(r#", "step_times_s": [0.1], "tokens_per_s": -1"#)),
        "tokens_per_s"
    );
    assert_eq!(
        invalid_field(&fits(r#", "step_times_s": [0.1], "peak": 3"#)),
        "peak"
    );
    assert_eq!(
        invalid_field(
            r#"{"protocol": 1, "outcome": "fits", "step_times_s": [0.1], "peak_gpu_bytes": 1, "peak_host_bytes": 1}"#
        ),
        "engine"
    );
    assert_eq!(
        invalid_field(r#"{"protocol": 1, "outcome": "error", "engine": " ", "reason": "x"}"#),
        "engine"
    );
    assert_eq!(
        invalid_field(r#"{"protocol": 1, "outcome": "finished", "engine": "pytorch"}"#),
        "outcome"
    );
    assert_eq!(
        invalid_field(r#"{"protocol": 1, "engine": "pytorch"}"#),
        "outcome"
    );
    assert_eq!(
        invalid_field(
            r#"{"protocol": 1, "outcome": "out_of_memory", "engine": "pytorch", "memory": "disk"}"#
        ),
        "memory"
    );
    assert_eq!(
        invalid_field(
            r#"{"protocol": 1, "outcome": "error", "engine": "pytorch", "reusable": "yes", "reason": "x"}"#
        ),
        "reusable"
    );
}

#[test]
fn an_engine_name_is_trimmed_and_bounded_in_characters() {
    let longest = "é".repeat(MAX_ENGINE_NAME_CHARS);
    let too_long = "e".repeat(MAX_ENGINE_NAME_CHARS + 1);
    for (given, expected) in [
        ("pytorch", Some("pytorch")),
        ("  jax\t", Some("jax")),
        (longest.as_str(), Some(longest.as_str())),
        ("", None),
        (" \n ", None),
        ("py\u{7}torch", None),
        (too_long.as_str(), None),
    ] {
        assert_eq!(engine_name(given).ok().as_deref(), expected, "{given:?}");
    }
}

#[test]
fn a_reply_of_version_2_answers_only_the_request_whose_id_it_echoes() {
    let line = |id: &str| {
        format!(
            r#"{{"protocol": 2{id}, "outcome": "out_of_memory", "engine": "pytorch",
                "memory": "gpu"}}"#
        )
    };
    assert!(matches!(
        reply(&line(r#", "id": 7"#)).answer,
        RunnerAnswer::OutOfMemory { .. }
    ));
    assert!(matches!(
        parse_reply_line(&line(r#", "id": 6"#), ID),
        Some(Err(BadReply::AnotherRequest(6)))
    ));
    assert_eq!(invalid_field(&line("")), "id");
    assert_eq!(invalid_field(&line(r#", "id": "7""#)), "id");
    // Version 1 carries no id: matched by order, and an id there is a field it lacks.
    let v1 = r#"{"protocol": 1, "outcome": "error", "engine": "pytorch", "reason": "x"}"#;
    assert!(matches!(reply(v1).answer, RunnerAnswer::Error { .. }));
    assert_eq!(
        invalid_field(
            r#"{"protocol": 1, "id": 7, "outcome": "error", "engine": "pytorch", "reason": "x"}"#
        ),
        "id"
    );
}

#[test]
fn a_reply_with_nan_or_infinity_is_refused_naming_the_field_unless_it_is_anothers() {
    let nan = r#"{"protocol": 2, "id": 7, "outcome": "fits", "engine": "pytorch",
                  "step_times_s": [0.1, NaN], "peak_gpu_bytes": 1, "peak_host_bytes": 1}"#;
    match parse_reply_line(nan, ID) {
        Some(Err(BadReply::Invalid(e))) => {
            let text = e.to_string();
            assert!(
                text.contains("step_times_s[1]") && text.contains("NaN"),
                "{text}"
            );
        }
        other => panic!("{other:?}"),
    }
    let v1 = r#"{"protocol": 1, "outcome": "fits", "tokens_per_s": Infinity}"#;
    assert_eq!(invalid_field(v1), "tokens_per_s");
    assert!(matches!(
        parse_reply_line(&nan.replace("\"id\": 7", "\"id\": 3"), ID),
        Some(Err(BadReply::AnotherRequest(3)))
    ));
    assert!(parse_reply_line(r#"{"loss": NaN}"#, ID).is_none());
}

#[test]
fn a_fit_faster_than_physically_possible_is_refused_naming_its_step_times() {
    // 16 sequences of 64 tokens in 2 µs: 5e8 tokens/s is possible, in 1 µs at 2^20 tokens not.
    let fit = |t: &str| {
        reply(&format!(
            r#"{{"protocol": 1, "outcome": "fits", "engine": "pytorch", "step_times_s": [{t}],
                "peak_gpu_bytes": 1, "peak_host_bytes": 1}}"#
        ))
    };
    assert!(fit("2e-6").outcome(&knobs(8), 64).is_ok());
    match fit("1e-6").outcome(&knobs(8), 1 << 16) {
        Err(Error::InvalidSpec { field, problem, .. }) => {
            assert_eq!(field, "step_times_s");
            assert!(problem.contains("tokens/s"), "{problem}");
        }
        other => panic!("{other:?}"),
    }
}
