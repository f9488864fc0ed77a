//! `autotune probe`: measure one setting with real steps and print the outcome.

use serde::Serialize;

use autotune::backend as device;
use autotune::dist::probe::DataParallelProber;
use autotune::probe::job::{TrialProcesses, TrialSetup};
use autotune::probe::live::LiveProber;
use autotune::probe::{child, worker, Prober};
use autotune::trial::{Outcome, TrialRequest, TrialResult};
use autotune::ModelSpec;

use autotune::spec::limits;

use super::args::ProbeArgs;
use super::printer::Printer;
use super::reporters::{bytes, memory_name};
use super::Status;
use autotune::settings::flags::{self, as_flag};

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
    let spec = ModelSpec::resolve(&args.model.model)?;
    let knobs = args.knobs.knobs();
    let host_budget = args.host_budget.as_deref().map(parse_bytes).transpose()?;
    let request = TrialRequest {
        knobs,
        warmup_steps: args.warmup,
        timed_steps: args.steps,
    };
    request
        .validate("knobs", "")
        .and_then(|()| limits::check_knobs(&spec, &knobs, "knobs", ""))
        .map_err(|e| as_flag(e, flags::PROBE))?;
    let gpu_capacity = args.gpu_capacity.as_deref().map(parse_bytes).transpose()?;
    let (result, device_name) = if knobs.data_parallel.degree > 1 {
        probe_data_parallel(&args, &spec, &request, gpu_capacity, host_budget, printer)?
    } else {
        let device = device::open(&args.model.device)?;
        printer.status(format!(
            "probing {} at {knobs} on {}",
            spec.name,
            device::describe(&device)
        ));
        let memory = device::memory_meter(&device, gpu_capacity)?;
        let result = LiveProber::new(&spec, &device, host_budget, memory)
            .with_engine(args.model.engine)
            .probe(&request)?;
        (result, device::describe(&device).to_string())
    };
    printer.data_json_line(&ProbeLine {
        implementation: "autotune",
        model: &spec.name,
        precision: knobs.precision,
        micro_batch: knobs.micro_batch,
        seq_len: spec.seq_len,
        params: spec.parameter_count(),
        device: device_name,
        result: &result,
    });
    match &result.outcome {
        Outcome::Fits(m) => printer.data_text(format!(
            "fits: {:.1} ms/step, {:.0} tokens/s, peak GPU {}, peak host {}",
            m.step_time_median_s * 1e3,
            m.tokens_per_s,
            bytes(m.peak_gpu_bytes),
            bytes(m.peak_host_bytes)
        )),
        Outcome::OutOfMemory { memory, phase } => printer.data_text(format!(
            "out of {} memory during {phase:?}",
            memory_name(*memory)
        )),
        Outcome::Crashed { reason } => printer.data_text(format!("crashed: {reason}")),
        Outcome::TimedOut { after_s } => {
            printer.data_text(format!("timed out after {after_s:.0} s"))
        }
    }
    Ok(match result.outcome {
        Outcome::Fits(_) => Status::Success,
        _ => Status::Negative,
    })
}

/// A data-parallel trial: the ranks run as `probe-one` children, one per GPU.
fn probe_data_parallel(
    args: &ProbeArgs,
    spec: &ModelSpec,
    request: &TrialRequest,
    gpu_capacity: Option<u64>,
    host_budget: Option<u64>,
    printer: &Printer,
) -> anyhow::Result<(TrialResult, String)> {
    if args.model.engine != autotune::model::Engine::default() {
        anyhow::bail!("`--engine` applies to single-GPU trials; drop it or --data-parallel");
    }
    let degree = request.knobs.data_parallel.degree;
    let device_name = match args.model.device.as_str() {
        "auto" if device::cuda_device_count() > 0 => "cuda",
        "auto" | "cpu" => "cpu",
        _ => "cuda",
    };
    autotune::dist::probe::check_degree(degree, device_name, "--data-parallel")?;
    printer.status(format!(
        "probing {} at {} on {degree} {device_name} ranks",
        spec.name, request.knobs
    ));
    let exe = std::env::current_exe()
        .map_err(|e| anyhow::anyhow!("cannot locate the autotune executable: {e}"))?;
    let setup = TrialSetup::new(spec, device_name, gpu_capacity, host_budget);
    let mut prober = DataParallelProber::new(TrialProcesses::new(exe, setup));
    Ok((prober.probe(request)?, device_name.to_string()))
}

/// The child's side of isolated trials (`probe-one`): one job on stdin, one result on stdout.
pub fn run_child() -> anyhow::Result<Status> {
    child::serve_one(std::io::stdin().lock(), &mut std::io::stdout().lock())?;
    Ok(Status::Success)
}

/// The worker's side of isolated trials (`probe-serve`): jobs on stdin until it ends, one
/// reply line each on stdout.
pub fn run_worker() -> anyhow::Result<Status> {
    worker::serve(std::io::stdin().lock(), &mut std::io::stdout().lock())?;
    Ok(Status::Success)
}

fn parse_bytes(text: &str) -> anyhow::Result<u64> {
    autotune::spec::budget::parse_bytes(text).map_err(|e| anyhow::anyhow!(e))
}
