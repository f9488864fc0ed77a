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
    format!(
        "GPU {}: {}, memory {} total, {} used, {} free, PCIe {} (at most {})",
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
