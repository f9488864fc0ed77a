//! `autotune tune`: search for the fastest feasible plan and write it.
//!
//! The pieces are the library's: a [`SearchDriver`] decides, a prober measures, the plan is
//! built from the history. This file only chooses the prober for the target device, renders
//! search events for people, and writes the outputs.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use candle_core::Device;
use serde::Serialize;

use autotune::backend;
use autotune::dist::probe::DataParallelProber;
use autotune::plan::schema::Plan;
use autotune::probe::child::ChildProber;
use autotune::probe::host_work::adam_update_floor_s;
use autotune::probe::live::LiveProber;
use autotune::probe::outcome::{Outcome, ProbeRequest, ProbeResult};
use autotune::probe::worker::WorkerProber;
use autotune::profile::record::{Profile, RecordedDevice};
use autotune::profile::replay::ReplayProber;
use autotune::search::decision::Decision;
use autotune::search::driver::SearchDriver;
use autotune::search::report::{Event, Purpose};
use autotune::search::run::{run_search, SearchOutcome};
use autotune::search::space::SearchSpace;
use autotune::spec::budget::Budget;
use autotune::spec::device::{DeviceKind, DeviceProfile};
use autotune::ModelSpec;

use super::args::{ProbeIsolation, TuneArgs};
use super::printer::Printer;
use super::Status;

/// What a finished search produced.
pub struct Tuned {
    pub spec: ModelSpec,
    pub profile: DeviceProfile,
    pub recorded: RecordedDevice,
    pub driver: SearchDriver,
    pub plan: Option<Plan>,
    pub outcome: SearchOutcome,
}

impl Tuned {
    /// The search as a recorded profile.
    fn record(&self) -> Profile {
        Profile::from_search(
            &self.driver,
            &self.outcome,
            &self.spec,
            self.recorded.clone(),
            now(),
        )
    }
}

pub fn run(args: TuneArgs, printer: &Printer) -> anyhow::Result<Status> {
    let tuned = tune(&args, printer)?;
    emit(&tuned, args.out.as_ref(), printer)
}

/// Runs the search described by `args`.
pub fn tune(args: &TuneArgs, printer: &Printer) -> anyhow::Result<Tuned> {
    let tuned = match args.backend.strip_prefix("replay:") {
        Some(path) => replay(Path::new(path), printer)?,
        None if args.backend == "live" => live(args, printer)?,
        None => anyhow::bail!(
            "unknown `--backend {}`; expected live or replay:PROFILE",
            args.backend
        ),
    };
    if let Some(path) = &args.record {
        tuned.record().save(path)?;
        printer.status(format!("profile recorded to {}", path.display()));
    }
    Ok(tuned)
}

/// Plans offline from a recorded profile: the recorded model, target and search space, with
/// every trial answered from the recording.
fn replay(path: &Path, printer: &Printer) -> anyhow::Result<Tuned> {
    let profile = Profile::load(path)?;
    let driver = profile.driver()?;
    let spec = profile.model.clone();
    let device = profile.device.clone();
    printer.status(format!(
        "replaying {} on {} from {} ({} recorded trials)",
        spec.name,
        device.profile.name,
        path.display(),
        profile.probes.len()
    ));
    let mut prober = ReplayProber::new(profile);
    let progress = SearchProgress::new(printer);
    let outcome = run_search(
        &driver,
        &mut |r: &ProbeRequest| Ok(prober.probe(r)),
        &progress,
    )?;
    progress.finish();
    let plan = Plan::from_search(&driver, &outcome, &spec, &device.profile, now());
    Ok(Tuned {
        spec,
        profile: device.profile.clone(),
        recorded: device,
        driver,
        plan,
        outcome,
    })
}

fn live(args: &TuneArgs, printer: &Printer) -> anyhow::Result<Tuned> {
    let spec = ModelSpec::resolve(&args.model)?;
    let profile = target_profile(&args.device)?;
    let mut budget = Budget::from_device(&profile);
    if let Some(h) = args.headroom {
        budget.headroom = h;
    }
    budget.validate()?;
    let mut space = search_space(args, &profile)?;
    if space
        .regimes
        .iter()
        .any(|r| r.offload == autotune::Offload::Optimizer)
    {
        space.offload_host_floor_s = adam_update_floor_s(spec.parameter_count());
        tracing::debug!(
            floor_s = space.offload_host_floor_s,
            "host update floor for offloaded regimes"
        );
    }
    let driver = SearchDriver::new(space, budget)?;
    let data_parallel = driver
        .space()
        .regimes
        .iter()
        .any(|r| r.data_parallel.degree > 1);
    let isolation = if data_parallel {
        // An in-process trial keeps its memory pool on GPU 0, where rank 0 of the next
        // data-parallel trial would find it missing.
        ProbeIsolation::Child
    } else {
        args.isolation
            .unwrap_or_else(|| ProbeIsolation::default_for(profile.kind))
    };
    // Only in-process trials use a device here: with child trials this process opens none, so
    // its CUDA context takes no memory from the children's (emulated) card.
    let device = match (profile.kind, isolation) {
        (DeviceKind::Cuda, ProbeIsolation::InProcess) => Some(backend::open("cuda")?),
        (DeviceKind::Cuda, ProbeIsolation::Child | ProbeIsolation::Worker) => {
            backend::require_cuda_build()?;
            None
        }
        (DeviceKind::Cpu, _) => None,
    };
    let device_name = match profile.kind {
        DeviceKind::Cpu => "cpu",
        DeviceKind::Cuda => "cuda",
    };
    printer.status(format!(
        "tuning {} ({:.1}M parameters, seq {}) for {} ({}), probing on {device_name}{}",
        spec.name,
        spec.parameter_count() as f64 / 1e6,
        spec.seq_len,
        profile.name,
        describe_budget(&budget),
        match isolation {
            ProbeIsolation::InProcess => "",
            ProbeIsolation::Child => " in child processes",
            ProbeIsolation::Worker => " in a worker process",
        },
    ));
    let progress = SearchProgress::new(printer);
    let exe = std::env::current_exe().context("cannot locate the autotune executable")?;
    // Trials of data-parallel regimes run as that many ranks, one process per GPU.
    let mut ranks = DataParallelProber::new(
        exe.clone(),
        &spec,
        device_name,
        profile.gpu_memory_bytes,
        Some(profile.host_memory_bytes),
    );
    let outcome = match isolation {
        ProbeIsolation::InProcess => {
            let device = device.clone().unwrap_or(Device::Cpu);
            let mut meter = backend::memory_meter(&device, profile.gpu_memory_bytes)?;
            let mut prober = LiveProber::new(
                &spec,
                &device,
                Some(profile.host_memory_bytes),
                meter.as_mut(),
            );
            run_search(&driver, &mut |r: &ProbeRequest| prober.probe(r), &progress)?
        }
        ProbeIsolation::Child => {
            let mut prober = ChildProber::new(
                exe,
                &spec,
                device_name,
                profile.gpu_memory_bytes,
                Some(profile.host_memory_bytes),
            );
            let mut probe = with_ranks(|r: &ProbeRequest| prober.probe(r), &mut ranks);
            run_search(&driver, &mut probe, &progress)?
        }
        ProbeIsolation::Worker => {
            let mut prober = WorkerProber::new(
                exe,
                &spec,
                device_name,
                profile.gpu_memory_bytes,
                Some(profile.host_memory_bytes),
            );
            let mut probe = with_ranks(|r: &ProbeRequest| prober.probe(r), &mut ranks);
            let outcome = run_search(&driver, &mut probe, &progress)?;
            drop(probe);
            tracing::debug!(workers = prober.workers_started(), "probe workers started");
            outcome
        }
    };
    progress.finish();
    let mut plan = Plan::from_search(&driver, &outcome, &spec, &profile, now());
    if let Some(plan) = plan.as_mut() {
        // Scaling efficiency is measured, never assumed: one GPU's trial if the search ran none.
        plan.measure_scaling(driver.space(), &mut |r| ranks.probe(r))?;
    }
    let recorded = backend::recorded_device(profile.kind == DeviceKind::Cuda, &profile);
    Ok(Tuned {
        spec,
        profile,
        recorded,
        driver,
        plan,
        outcome,
    })
}

/// A probe function that runs one-GPU trials with `single` and data-parallel ones on `ranks`.
fn with_ranks<'a>(
    mut single: impl FnMut(&ProbeRequest) -> autotune::Result<ProbeResult> + 'a,
    ranks: &'a mut DataParallelProber,
) -> impl FnMut(&ProbeRequest) -> autotune::Result<ProbeResult> + 'a {
    move |r: &ProbeRequest| match r.knobs.data_parallel.degree {
        1 => single(r),
        _ => ranks.probe(r),
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Writes the plan (or the negative answer) and maps it to an exit status.
pub fn emit(tuned: &Tuned, out: Option<&PathBuf>, printer: &Printer) -> anyhow::Result<Status> {
    let Some(plan) = &tuned.plan else {
        let hint = match &tuned.outcome.decision {
            Decision::NoFeasible { hint } => hint.clone(),
            other => format!("the search ended without a verified plan ({other:?})"),
        };
        printer.data_json(&NoPlan {
            feasible: false,
            hint: &hint,
            evidence: &tuned.outcome.history,
        });
        printer.data_text(format!(
            "no feasible plan for {} on {}\nhint: {hint}",
            tuned.spec.name, tuned.profile.name
        ));
        return Ok(Status::Negative);
    };
    if let Some(path) = out {
        plan.save(path)?;
        printer.status(format!("plan written to {}", path.display()));
    }
    printer.data_json(plan);
    printer.data_text(summary(plan));
    Ok(Status::Success)
}

#[derive(Serialize)]
struct NoPlan<'a> {
    feasible: bool,
    hint: &'a str,
    evidence: &'a [ProbeResult],
}

fn summary(plan: &Plan) -> String {
    let m = &plan.measured;
    let mut text = format!(
        "plan: {}\n  measured {:.0} tokens/s ({:.1} ms/step), peak GPU {}, peak host {}\n  {} trials",
        plan.knobs,
        m.tokens_per_s,
        m.step_time_median_s * 1e3,
        gib(m.peak_gpu_bytes),
        gib(m.peak_host_bytes),
        plan.evidence.len(),
    );
    if let Some(e) = plan.model_error.memory_loo_rel_error {
        text.push_str(&format!(", memory model held-out error {:.1}%", e * 100.0));
    }
    text
}

/// The regimes to search: every combination of the given precisions, checkpointing and offload
/// settings (an empty list means those of the default space), default regimes first in their
/// priority order, then the others.
fn regimes(
    defaults: Vec<autotune::Regime>,
    precisions: &[autotune::Precision],
    checkpointing: &[autotune::Checkpointing],
    offload: &[autotune::Offload],
) -> Vec<autotune::Regime> {
    fn or_defaults<T: Copy + PartialEq>(given: &[T], defaults: impl Iterator<Item = T>) -> Vec<T> {
        if !given.is_empty() {
            return given.to_vec();
        }
        let mut out = Vec::new();
        for d in defaults {
            if !out.contains(&d) {
                out.push(d);
            }
        }
        out
    }
    let p = or_defaults(precisions, defaults.iter().map(|r| r.precision));
    let c = or_defaults(checkpointing, defaults.iter().map(|r| r.checkpointing));
    let o = or_defaults(offload, defaults.iter().map(|r| r.offload));
    let wanted = |r: &autotune::Regime| {
        p.contains(&r.precision) && c.contains(&r.checkpointing) && o.contains(&r.offload)
    };
    let mut out: Vec<autotune::Regime> = defaults.into_iter().filter(wanted).collect();
    for &precision in &p {
        for &checkpointing in &c {
            for &offload in &o {
                let r = autotune::Regime {
                    precision,
                    checkpointing,
                    offload,
                    data_parallel: autotune::knobs::DataParallel::SINGLE,
                };
                if !out.contains(&r) {
                    out.push(r);
                }
            }
        }
    }
    out
}

/// `auto` (the local GPU, or the built-in CPU profile), a built-in name, or a JSON file.
pub fn target_profile(name: &str) -> anyhow::Result<DeviceProfile> {
    if name != "auto" {
        return Ok(DeviceProfile::resolve(name)?);
    }
    match backend::detect_gpu_profile()? {
        Some(profile) => Ok(profile),
        None => Ok(DeviceProfile::builtin("cpu")?),
    }
}

fn search_space(args: &TuneArgs, profile: &DeviceProfile) -> anyhow::Result<SearchSpace> {
    let regimes = regimes(
        SearchSpace::default_regimes(profile.kind),
        &args.precision,
        &args.checkpointing,
        &args.offload,
    );
    let degrees = SearchSpace::data_parallel_degrees(
        &args.data_parallel,
        profile.gpu_count,
        args.global_batch,
    )?;
    let regimes = SearchSpace::with_data_parallel(&regimes, &degrees);
    // One warm-up step suffices on both: trials share the device's memory pool, so the first
    // step's allocations are already cached after the first trial; three timed steps give a
    // median. The chosen setting's verification times more.
    let (warmup, timed, verify) = match profile.kind {
        DeviceKind::Cpu => (1, 3, 5),
        DeviceKind::Cuda => (1, 3, 6),
    };
    let space = SearchSpace {
        max_micro_batch: args.max_micro_batch,
        global_batch: args.global_batch,
        warmup_steps: args.warmup_steps.unwrap_or(warmup),
        timed_steps: args.timed_steps.unwrap_or(timed),
        verify_timed_steps: verify,
        max_probes: args.max_probes,
        saturation_gain: args.saturation_gain,
        ..SearchSpace::new(regimes)
    };
    space.validate()?;
    Ok(space)
}

fn describe_budget(budget: &Budget) -> String {
    let host = format!("host {}", gib(budget.host_bytes));
    match budget.gpu_bytes {
        Some(g) => format!(
            "GPU {}, {host}, headroom {:.0}%",
            gib(g),
            budget.headroom * 100.0
        ),
        None => format!("{host}, headroom {:.0}%", budget.headroom * 100.0),
    }
}

pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Renders search events on stderr: a spinner while a trial runs, one line when it ends.
struct SearchProgress {
    printer: Printer,
    bar: indicatif::ProgressBar,
}

impl SearchProgress {
    fn new(printer: &Printer) -> Self {
        let bar = printer.spinner();
        Self {
            printer: *printer,
            bar,
        }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl autotune::search::report::Reporter for SearchProgress {
    fn report(&self, event: &Event) {
        match event {
            Event::ProbeStarted {
                index,
                request,
                purpose,
            } => {
                let what = if *purpose == Purpose::Verify {
                    "verifying"
                } else {
                    "probing"
                };
                self.bar
                    .set_message(format!("[{}] {what} {}", index + 1, request.knobs));
            }
            Event::ProbeFinished {
                index,
                result,
                feasible,
                ..
            } => {
                let line = format!(
                    "[{}] {}: {}",
                    index + 1,
                    result.request.knobs,
                    describe(result, *feasible)
                );
                self.bar.suspend(|| self.printer.status(line));
            }
            Event::RegimeDone {
                regime,
                end,
                probes,
                ..
            } => {
                let line = format!("  {regime}: {end:?} after {probes} trials");
                self.bar.suspend(|| self.printer.detail(line));
            }
            Event::Verified { .. } | Event::Finished { .. } => {}
        }
    }
}

fn describe(result: &ProbeResult, feasible: bool) -> String {
    match &result.outcome {
        Outcome::Fits(m) => format!(
            "{} {:.0} tokens/s, peak GPU {}, host {}",
            if feasible {
                "fits,"
            } else {
                "fits but above the headroom,"
            },
            m.tokens_per_s,
            gib(m.peak_gpu_bytes),
            gib(m.peak_host_bytes)
        ),
        Outcome::OutOfMemory { memory, phase } => {
            format!("out of {memory:?} memory during {phase:?}")
        }
        Outcome::Crashed { reason } => format!("crashed: {reason}"),
    }
}

#[cfg(test)]
mod tests {
    use autotune::{Checkpointing, Offload, Precision, Regime};

    use super::regimes;

    fn r(precision: Precision, checkpointing: Checkpointing, offload: Offload) -> Regime {
        Regime {
            precision,
            checkpointing,
            offload,
            data_parallel: autotune::knobs::DataParallel::SINGLE,
        }
    }

    fn gpu_defaults() -> Vec<Regime> {
        let (none, all) = (Checkpointing::None, Checkpointing::EveryKth(1));
        vec![
            r(Precision::Bf16, none, Offload::None),
            r(Precision::Bf16, all, Offload::None),
            r(Precision::Bf16, none, Offload::Optimizer),
            r(Precision::Bf16, all, Offload::Optimizer),
        ]
    }

    #[test]
    fn empty_filters_keep_the_default_space() {
        assert_eq!(regimes(gpu_defaults(), &[], &[], &[]), gpu_defaults());
    }

    #[test]
    fn filters_narrow_the_default_space_in_its_order() {
        let plain = regimes(
            gpu_defaults(),
            &[],
            &[Checkpointing::None],
            &[Offload::None],
        );
        assert_eq!(plain, vec![gpu_defaults()[0]]);
        let no_offload = regimes(gpu_defaults(), &[], &[], &[Offload::None]);
        assert_eq!(no_offload, gpu_defaults()[..2].to_vec());
    }

    #[test]
    fn new_values_combine_with_the_others_after_the_defaults() {
        let got = regimes(
            gpu_defaults(),
            &[Precision::Bf16, Precision::Fp16],
            &[Checkpointing::None, Checkpointing::EveryKth(2)],
            &[Offload::None],
        );
        assert_eq!(
            got,
            vec![
                gpu_defaults()[0],
                r(Precision::Bf16, Checkpointing::EveryKth(2), Offload::None),
                r(Precision::Fp16, Checkpointing::None, Offload::None),
                r(Precision::Fp16, Checkpointing::EveryKth(2), Offload::None),
            ]
        );
    }
}
