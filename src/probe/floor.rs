//! Trials answered before they run: a CPU trial whose training state and one micro-batch's
//! logits alone exceed its host memory cannot fit, and running it would not end in an
//! out-of-memory outcome but in an allocation the process cannot survive (Rust aborts when the
//! allocator fails, and the kernel kills a process that touches more than the machine has).

use candle_core::Device;

use crate::backend::host_memory_bytes;
use crate::knobs::Knobs;
use crate::spec::limits;
use crate::spec::model::ModelSpec;
use crate::trial::MemoryKind;

/// The memory a trial of `spec` at `knobs` on `device` certainly runs out of, when its floor
/// exceeds the host budget (or, without one, the machine's memory). Only the CPU is judged: a
/// GPU reports its own out-of-memory as an error the trial turns into an outcome.
pub fn certain_out_of_memory(
    spec: &ModelSpec,
    knobs: &Knobs,
    device: &Device,
    host_budget: Option<u64>,
) -> Option<MemoryKind> {
    if !device.is_cpu() {
        return None;
    }
    let available = match (host_budget, host_memory_bytes()) {
        (Some(budget), Some(machine)) => budget.min(machine),
        (Some(bytes), None) | (None, Some(bytes)) => bytes,
        (None, None) => return None,
    };
    let floor = if knobs.data_parallel.shard_optimizer {
        // Each rank keeps only its share of the moments: weights and gradients are the floor.
        (spec.parameter_count() as u64)
            .saturating_mul(8)
            .saturating_add(limits::logits_bytes(
                spec,
                knobs.micro_batch,
                knobs.precision,
            ))
    } else {
        limits::setting_floor_bytes(spec, knobs)
    };
    (floor > available).then_some(MemoryKind::Host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::Precision;

    #[test]
    fn a_cpu_trial_beyond_its_budget_is_out_of_memory_before_it_runs() {
        let tiny = ModelSpec::tiny();
        let knobs = Knobs::new(4, Precision::Fp32);
        let floor = limits::setting_floor_bytes(&tiny, &knobs);
        let cpu = Device::Cpu;
        assert_eq!(
            certain_out_of_memory(&tiny, &knobs, &cpu, Some(floor - 1)),
            Some(MemoryKind::Host)
        );
        assert_eq!(
            certain_out_of_memory(&tiny, &knobs, &cpu, Some(floor)),
            None
        );
        let huge = Knobs::new(1 << 20, Precision::Fp32);
        assert_eq!(
            certain_out_of_memory(&tiny, &huge, &cpu, Some(u64::MAX)).is_some(),
            host_memory_bytes().is_some_and(|m| m < limits::setting_floor_bytes(&tiny, &huge))
        );
    }
}
