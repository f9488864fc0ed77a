//! `autotune device`: what this machine has to train on, as nvidia-smi and free would show it,
//! and what this build can use.

use autotune::backend::machine::{Build, Gpu, Machine};
use autotune::settings::show::DeviceArgs;

use super::printer::Printer;
use super::reporters::bytes;
use super::Status;

pub fn run(_args: DeviceArgs, printer: &Printer) -> anyhow::Result<Status> {
    let machine = Machine::detect();
    printer.data_json(&machine);
    printer.data_text(describe(&machine));
    Ok(Status::Success)
}

fn known(value: Option<u64>) -> String {
    value.map_or("unknown".to_string(), bytes)
}

fn gpu_line(gpu: &Gpu) -> String {
    let link = |generation: Option<u32>, width: Option<u32>| match (generation, width) {
        (Some(g), Some(w)) => format!("gen {g} x{w}"),
        _ => "unknown".to_string(),
    };
    let capability = match (&gpu.compute_capability, gpu.fp8_tensor_cores) {
        (Some(c), Some(true)) => format!("compute {c}, fp8 tensor cores"),
        (Some(c), _) => format!("compute {c}, no fp8 tensor cores"),
        (None, _) => "compute capability unknown".to_string(),
    };
    format!(
        "GPU {}: {}, memory {} total, {} used, {} free, PCIe {} (at most {}), {capability}",
        gpu.index,
        gpu.name,
        known(gpu.memory_total_bytes),
        known(gpu.memory_used_bytes),
        known(gpu.memory_free_bytes),
        link(gpu.pcie_generation, gpu.pcie_width),
        link(gpu.pcie_max_generation, gpu.pcie_max_width),
    )
}

fn describe(machine: &Machine) -> String {
    let build = match machine.build {
        Build::Cpu => "CPU only",
        Build::Cuda => "CUDA",
        Build::CudaNccl => "CUDA with NCCL",
    };
    let mut lines = vec![format!("build: {build}")];
    if machine.driver.is_some() || machine.cuda.is_some() {
        lines.push(format!(
            "driver {}, CUDA {}",
            machine.driver.as_deref().unwrap_or("unknown"),
            machine.cuda.as_deref().unwrap_or("unknown")
        ));
    }
    lines.extend(machine.gpus.iter().map(gpu_line));
    if let Some(note) = &machine.note {
        lines.push(format!("no GPU: {note}"));
    }
    lines.push(format!(
        "host memory: {} total, {} available",
        known(machine.host.total_bytes),
        known(machine.host.available_bytes)
    ));
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(name: &str, capability: Option<&str>, fp8: Option<bool>) -> Gpu {
        Gpu {
            index: 0,
            name: name.into(),
            memory_total_bytes: Some(24 << 30),
            memory_used_bytes: None,
            memory_free_bytes: None,
            pcie_generation: Some(4),
            pcie_width: Some(16),
            pcie_max_generation: Some(4),
            pcie_max_width: Some(16),
            compute_capability: capability.map(str::to_string),
            fp8_tensor_cores: fp8,
        }
    }

    #[test]
    fn a_gpu_line_says_whether_fp8_runs_there() {
        let rows = [
            (
                gpu("RTX 4090", Some("8.9"), Some(true)),
                "compute 8.9, fp8 tensor cores",
            ),
            (
                gpu("RTX 3090", Some("8.6"), Some(false)),
                "compute 8.6, no fp8 tensor cores",
            ),
            (gpu("unknown", None, None), "compute capability unknown"),
        ];
        for (gpu, says) in rows {
            let line = gpu_line(&gpu);
            assert!(line.ends_with(says), "{line}");
            assert!(line.contains("PCIe gen 4 x16"), "{line}");
        }
    }
}
