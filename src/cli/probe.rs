//! `autotune probe`: measure one setting with real steps and print the outcome.

use serde::Serialize;

use autotune::probe::{child, lifetime, worker};
use autotune::session;
use autotune::session::probe::Probed;
use autotune::settings::probe::{ProbeArgs, ProbeSettings};
use autotune::trial::{Outcome, TrialResult};

use super::printer::Printer;
use super::reporters::{bytes, failure};
use super::Status;

/// The JSON line the GPU benchmark scripts read (one object, `impl` = "autotune").
#[derive(Serialize)]
struct ProbeLine<'a> {
    #[serde(rename = "impl")]
    implementation: &'static str,
    model: &'a str,
    precision: autotune::Precision,
    micro_batch: usize,
    seq_len: usize,
    params: usize,
    device: String,
    #[serde(flatten)]
    result: &'a TrialResult,
}

pub fn run(args: ProbeArgs, printer: &Printer) -> anyhow::Result<Status> {
    let settings = ProbeSettings::from_args(&args)?;
    let (spec, knobs) = (&settings.spec, settings.request.knobs);
    let Probed { result, device } = session::probe::probe(&settings, &|on| {
        printer.status(format!("probing {} at {knobs} on {on}", spec.name))
    })?;
    printer.data_json_line(&ProbeLine {
        implementation: "autotune",
        model: &spec.name,
        precision: knobs.precision,
        micro_batch: knobs.micro_batch,
        seq_len: spec.seq_len,
        params: spec.parameter_count(),
        device,
        result: &result,
    });
    printer.data_text(outcome_line(&result.outcome));
    Ok(match result.outcome {
        Outcome::Fits(_) => Status::Success,
        _ => Status::Negative,
    })
}

/// A trial's outcome as people read it.
fn outcome_line(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Fits(m) => format!(
            "fits: {:.1} ms/step, {:.0} tokens/s, peak GPU {}, peak host {}",
            m.step_time_median_s * 1e3,
            m.tokens_per_s,
            bytes(m.peak_gpu_bytes),
            bytes(m.peak_host_bytes)
        ),
        other => failure(other),
    }
}

/// The child's side of isolated trials (`probe-one`): one job on stdin, one result on stdout.
pub fn run_child() -> anyhow::Result<Status> {
    lifetime::end_with_parent()?;
    child::serve_one(std::io::stdin().lock(), &mut std::io::stdout().lock())?;
    Ok(Status::Success)
}

/// The worker's side of isolated trials (`probe-serve`): jobs on stdin until it ends, one
/// reply line each on stdout.
pub fn run_worker() -> anyhow::Result<Status> {
    lifetime::end_with_parent()?;
    worker::serve(std::io::stdin().lock(), &mut std::io::stdout().lock())?;
    Ok(Status::Success)
}
