//! `autotune probe`: measure one setting with real steps and print the outcome.

use std::io::BufRead;

use serde::Serialize;

use autotune::dist::probe::DataParallelProber;
use autotune::dist::rank::rank_device;
use autotune::dist::{Collective, RankEnv};
use autotune::probe::child::ChildJob;
use autotune::probe::live::LiveProber;
use autotune::probe::outcome::{Outcome, ProbeRequest, ProbeResult};
use autotune::probe::worker::WorkerReply;
use autotune::ModelSpec;

use super::args::ProbeArgs;
use super::printer::Printer;
use super::Status;
use autotune::backend as device;

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
    result: &'a ProbeResult,
}

pub fn run(args: ProbeArgs, printer: &Printer) -> anyhow::Result<Status> {
    let spec = ModelSpec::resolve(&args.model.model)?;
    let knobs = args.knobs.knobs();
    knobs.validate("knobs", "--")?;
    let host_budget = args.host_budget.as_deref().map(parse_bytes).transpose()?;
    let request = ProbeRequest {
        knobs,
        warmup_steps: args.warmup,
        timed_steps: args.steps,
    };
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
        let mut memory = device::memory_meter(&device, gpu_capacity)?;
        let result = LiveProber::new(&spec, &device, host_budget, memory.as_mut())
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
            "fits: {:.1} ms/step, {:.0} tokens/s, peak GPU {:.2} GiB, peak host {:.2} GiB",
            m.step_time_median_s * 1e3,
            m.tokens_per_s,
            m.peak_gpu_bytes as f64 / GIB,
            m.peak_host_bytes as f64 / GIB
        )),
        Outcome::OutOfMemory { memory, phase } => {
            printer.data_text(format!("out of memory: {memory:?} during {phase:?}"))
        }
        Outcome::Crashed { reason } => printer.data_text(format!("crashed: {reason}")),
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
    request: &ProbeRequest,
    gpu_capacity: Option<u64>,
    host_budget: Option<u64>,
    printer: &Printer,
) -> anyhow::Result<(ProbeResult, String)> {
    if args.model.engine != autotune::model::Engine::default() {
        anyhow::bail!("`--engine` applies to single-GPU probes; drop it or --data-parallel");
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
    let mut prober = DataParallelProber::new(exe, spec, device_name, gpu_capacity, host_budget);
    Ok((prober.probe(request)?, device_name.to_string()))
}

/// The child side of isolated probing: one job on stdin, one result line on stdout. Started
/// as a rank (the rank variables are set), it runs the trial together with the other ranks.
pub fn run_child(printer: &Printer) -> anyhow::Result<Status> {
    let job: ChildJob = serde_json::from_reader(std::io::stdin().lock())
        .map_err(|e| anyhow::anyhow!("probe-one: the job on stdin is not valid JSON: {e}"))?;
    let rank = RankEnv::from_env()?;
    let device_name = match &rank {
        Some(r) => rank_device(&job.device, r.rank),
        None => job.device.clone(),
    };
    let device = device::open(&device_name)?;
    let mut memory = device::memory_meter(&device, job.gpu_capacity)?;
    let mut prober = LiveProber::new(&job.model, &device, job.host_budget, memory.as_mut());
    if let Some(rank) = &rank {
        prober = prober.with_group(Collective::join(rank, &device)?);
    }
    let result = prober.probe(&job.request)?;
    printer.data_json_line(&result);
    Ok(Status::Success)
}

/// The worker side of isolated probing: jobs one per line on stdin, each answered by one
/// [`WorkerReply`] line on stdout, until the input ends. Every job must describe the same model,
/// device and budgets as the first (the device and its emulated capacity are set up once).
pub fn run_worker(printer: &Printer) -> anyhow::Result<Status> {
    let mut lines = std::io::stdin().lock().lines();
    let parse = |line: std::io::Result<String>| -> anyhow::Result<ChildJob> {
        let line = line.map_err(|e| anyhow::anyhow!("probe-serve: cannot read stdin: {e}"))?;
        serde_json::from_str(&line)
            .map_err(|e| anyhow::anyhow!("probe-serve: a job on stdin is not valid JSON: {e}"))
    };
    let Some(first) = lines.next() else {
        return Ok(Status::Success);
    };
    let first = parse(first)?;
    let device = device::open(&first.device)?;
    let mut memory = device::memory_meter(&device, first.gpu_capacity)?;
    let mut job = first.clone();
    loop {
        if (&job.model, &job.device, job.gpu_capacity, job.host_budget)
            != (
                &first.model,
                &first.device,
                first.gpu_capacity,
                first.host_budget,
            )
        {
            anyhow::bail!(
                "probe-serve: every job must name the first job's model, device and budgets"
            );
        }
        let result = LiveProber::new(&job.model, &device, job.host_budget, memory.as_mut())
            .probe(&job.request)?;
        let leftover_device_bytes = memory.leftover_bytes()?;
        printer.data_json_line(&WorkerReply {
            result,
            leftover_device_bytes,
        });
        match lines.next() {
            Some(line) => job = parse(line)?,
            None => return Ok(Status::Success),
        }
    }
}

const GIB: f64 = (1u64 << 30) as f64;

fn parse_bytes(text: &str) -> anyhow::Result<u64> {
    autotune::spec::budget::parse_bytes(text).map_err(|e| anyhow::anyhow!(e))
}
