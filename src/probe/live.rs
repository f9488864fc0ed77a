//! In-process trials: real warm-up and timed training steps on a candle device.
//!
//! A trial builds the model and optimizer, runs warm-up steps, times the measured steps
//! (synchronising the device before every clock read), then runs an evaluation pass and a
//! checkpoint dry run (the memory a save takes), because those are the paths where a batch
//! size found by training steps alone runs out of memory later. How long each part took is
//! logged at debug level (`trial phases`), to see what a trial costs besides its steps. Long,
//! agreeing steps end the timing early ([`super::timing`]); the measurement says how many ran.

use std::time::Instant;

use candle_core::Device;

use crate::backend::host_memory;
use crate::backend::memory::DeviceMemory;
use crate::collective::Collective;
use crate::data::source::{Data, DataSpec};
use crate::knobs::Knobs;
use crate::model::Engine;
use crate::spec::model::ModelSpec;
use crate::train::optimizer::OptimizerState;
use crate::train::step::Trainer;
use crate::trial::{
    HostLink, Measurement, MemoryKind, Outcome, Phase, Prober, TrialRequest, TrialResult,
};
use crate::{Error, Result};

/// Runs trials in this process.
pub struct LiveProber {
    spec: ModelSpec,
    device: Device,
    seed: u64,
    host_budget: Option<u64>,
    device_memory: Box<dyn DeviceMemory>,
    engine: Engine,
    /// This process's data-parallel group, for one trial of a data-parallel setting.
    group: Option<Collective>,
    /// The host link's measured speed, once an offloaded trial has needed it.
    link_gbps: Option<Option<f64>>,
}

impl LiveProber {
    /// A prober for `spec` on `device`, measuring device memory with `device_memory` (which on
    /// a GPU also holds back what an emulated smaller card lacks); `host_budget` (bytes of
    /// heap) makes exceeding it an out-of-memory outcome.
    pub fn new(
        spec: &ModelSpec,
        device: &Device,
        host_budget: Option<u64>,
        device_memory: Box<dyn DeviceMemory>,
    ) -> Self {
        Self {
            spec: spec.clone(),
            device: device.clone(),
            seed: 0,
            host_budget,
            device_memory,
            engine: Engine::default(),
            group: None,
            link_gbps: None,
        }
    }

    /// Runs the next trial as one rank of `group` (a data-parallel trial runs on every rank).
    pub fn with_group(mut self, group: Collective) -> Self {
        self.group = Some(group);
        self
    }

    /// Trains with `engine` instead of the default.
    pub fn with_engine(mut self, engine: Engine) -> Self {
        self.engine = engine;
        self
    }

    /// Device bytes still held once everything unused is released: 0 when the next trial
    /// starts as it would in a fresh process.
    pub fn leftover_device_bytes(&mut self) -> Result<u64> {
        self.device_memory.leftover_bytes()
    }

    fn run(&mut self, request: &TrialRequest) -> Result<TrialResult> {
        let started = Instant::now();
        let floor = super::floor::certain_out_of_memory(
            &self.spec,
            &request.knobs,
            &self.device,
            self.host_budget,
        );
        if let Some(memory) = floor {
            let phase = Phase::Setup;
            return Ok(TrialResult {
                request: *request,
                outcome: Outcome::OutOfMemory { memory, phase },
                wall_s: started.elapsed().as_secs_f64(),
            });
        }
        host_memory::set_soft_limit(self.host_budget);
        host_memory::reset_peak();
        self.device_memory.reset_peak()?;
        let outcome = self.trial(request);
        host_memory::set_soft_limit(None);
        // Everything the trial allocated is dropped by now; wait for the device to finish
        // freeing so the next trial starts from the same state.
        self.device.synchronize()?;
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(Failure::OutOfMemory(memory, phase)) => Outcome::OutOfMemory { memory, phase },
            Err(Failure::Error(e)) => return Err(e),
        };
        Ok(TrialResult {
            request: *request,
            outcome,
            wall_s: started.elapsed().as_secs_f64(),
        })
    }

    fn trial(&mut self, request: &TrialRequest) -> std::result::Result<Outcome, Failure> {
        let knobs = request.knobs;
        let mut clock = PhaseClock::start();
        let group = self.group.take().unwrap_or(Collective::Single);
        let mut trainer = Trainer::for_trial(&self.spec, knobs, &self.device, self.seed, group)
            .map_err(in_phase(Phase::Setup))?;
        trainer.set_engine(self.engine);
        let data = Data::open(&DataSpec::Random, &self.spec).map_err(Failure::Error)?;
        self.check_host(Phase::Setup)?;
        let setup_s = clock.lap();
        tracing::debug!(setup_s, "trial set up");
        let mut times = Vec::with_capacity(request.timed_steps);
        for i in 0..request.warmup_steps + request.timed_steps {
            if super::timing::timing_done(&times, request.timed_steps) {
                break;
            }
            self.device
                .synchronize()
                .map_err(|e| in_phase(Phase::ForwardBackward)(e.into()))?;
            let t0 = Instant::now();
            trainer
                .step(&data)
                .map_err(in_phase(Phase::ForwardBackward))?;
            self.device
                .synchronize()
                .map_err(|e| in_phase(Phase::OptimizerStep)(e.into()))?;
            if i >= request.warmup_steps {
                times.push(t0.elapsed().as_secs_f64());
            }
            self.device_memory.trace_marks(&format_args!("step {i}"));
            self.check_host(Phase::ForwardBackward)?;
        }
        let steps_s = clock.lap();
        let batch = data
            .batch(0, u64::MAX, 0, knobs.micro_batch, &self.device)
            .map_err(in_phase(Phase::Eval))?;
        trainer.eval_loss(&batch).map_err(in_phase(Phase::Eval))?;
        self.device_memory.trace_marks(&"eval");
        self.check_host(Phase::Eval)?;
        let eval_s = clock.lap();
        checkpoint_dry_run(&trainer).map_err(in_phase(Phase::Checkpoint))?;
        self.device_memory.trace_marks(&"checkpoint");
        self.check_host(Phase::Checkpoint)?;
        let checkpoint_s = clock.lap();
        tracing::debug!(
            %knobs,
            setup_s,
            steps_s,
            eval_s,
            checkpoint_s,
            "trial phases"
        );
        let peak_gpu_bytes = self.device_memory.peak_bytes().map_err(Failure::Error)?;
        let mut measured = measurement(&knobs, self.spec.seq_len, &times, peak_gpu_bytes);
        if let Some(bytes_per_step) = trainer.host_link_bytes_per_step() {
            drop(trainer);
            measured.host_link = self
                .link_gbps()
                .map_err(Failure::Error)?
                .map(|measured_gbps| HostLink {
                    bytes_per_step,
                    measured_gbps,
                    added_s: 0.0,
                });
        }
        Ok(Outcome::Fits(measured))
    }

    /// The host link's speed, measured by the first trial that asks (after its peaks are
    /// read, so the measurement's buffers count in no trial).
    fn link_gbps(&mut self) -> Result<Option<f64>> {
        if let Some(known) = self.link_gbps {
            return Ok(known);
        }
        let gbps = crate::ops::transfer::measure_gbps(&self.device)?;
        tracing::debug!(?gbps, "host link measured");
        self.link_gbps = Some(gbps);
        Ok(gbps)
    }

    fn check_host(&self, phase: Phase) -> std::result::Result<(), Failure> {
        if self.host_budget.is_some() && host_memory::limit_exceeded() {
            return Err(Failure::OutOfMemory(MemoryKind::Host, phase));
        }
        Ok(())
    }
}

impl Prober for LiveProber {
    /// Runs one trial. Out-of-memory is an outcome; only unexpected failures are errors.
    fn probe(&mut self, request: &TrialRequest) -> autotune_core::Result<TrialResult> {
        Ok(self.run(request)?)
    }
}

enum Failure {
    OutOfMemory(MemoryKind, Phase),
    Error(Error),
}

fn in_phase(phase: Phase) -> impl Fn(Error) -> Failure {
    move |e| {
        if is_out_of_memory(&e) {
            Failure::OutOfMemory(MemoryKind::Gpu, phase)
        } else {
            Failure::Error(e)
        }
    }
}

/// Whether a backend error is a device allocation failure (see [`super::oom`]).
pub fn is_out_of_memory(error: &Error) -> bool {
    super::oom::is_out_of_memory(error)
}

/// Seconds between successive laps of a trial.
struct PhaseClock(Instant);

impl PhaseClock {
    fn start() -> Self {
        Self(Instant::now())
    }

    /// Seconds since the previous lap (or the start).
    fn lap(&mut self) -> f64 {
        let now = Instant::now();
        let seconds = (now - self.0).as_secs_f64();
        self.0 = now;
        seconds
    }
}

/// Takes the memory a checkpoint save takes, without writing.
///
/// A save of on-device weights and moments copies one tensor at a time to the host and frees it
/// before the next; each copy reads the tensor's own storage, so it takes no device memory, and
/// its extra host memory is one tensor's bytes. The peaks of a save are therefore those of
/// copying its largest tensor alone, which is what this does: copying every tensor (12 bytes
/// per parameter, 2 GB for gpt-124m) would reach the same peaks and only take longer.
/// Offloaded masters and moments are streamed from host memory through one small buffer, so
/// streaming the largest parameter's masters alone reaches the save's peak.
fn checkpoint_dry_run(trainer: &Trainer) -> Result<()> {
    let params = trainer.model().params();
    match trainer.optimizer() {
        OptimizerState::Device(adam) => {
            let state = adam.state_tensors(params.names());
            let largest = params
                .vars()
                .iter()
                .map(|v| v.as_tensor())
                .chain(state.values())
                .max_by_key(|t| t.elem_count() * t.dtype().size_in_bytes());
            if let Some(t) = largest {
                // A real copy on the CPU too, where `to_device` would share the storage.
                drop(crate::train::checkpoint::host_copy(t)?);
            }
        }
        OptimizerState::Host(offload) => {
            offload
                .write_largest_master(std::io::sink(), params.names())
                .map_err(candle_core::Error::wrap)?;
        }
        OptimizerState::Compact(_) => {
            // The state is copied a tensor at a time too; the largest is a matrix's weights
            // (bf16 or f32), never smaller than its moments.
            let largest = params
                .vars()
                .iter()
                .map(|v| v.as_tensor())
                .max_by_key(|t| t.elem_count() * t.dtype().size_in_bytes());
            if let Some(t) = largest {
                drop(crate::train::checkpoint::host_copy(t)?);
            }
        }
    }
    Ok(())
}

fn measurement(knobs: &Knobs, seq_len: usize, times: &[f64], peak_gpu_bytes: u64) -> Measurement {
    let tokens = (knobs.global_batch() * seq_len) as f64;
    Measurement::from_step_times(times, tokens, peak_gpu_bytes, host_memory::peak_bytes())
}
