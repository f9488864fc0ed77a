//! This machine as `autotune device` reports it: the build, every GPU NVML sees (memory,
//! driver, CUDA, PCIe link), and the host's memory.

use serde::Serialize;

/// What this binary was built to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Build {
    /// The default build: the CPU only.
    Cpu,
    /// With candle's CUDA backend and NVML (`--features cuda`).
    Cuda,
    /// CUDA with NCCL for data parallelism (`--features nccl`).
    CudaNccl,
}

impl Build {
    /// This binary's build.
    pub fn current() -> Self {
        if cfg!(feature = "nccl") {
            Build::CudaNccl
        } else if cfg!(feature = "cuda") {
            Build::Cuda
        } else {
            Build::Cpu
        }
    }

    /// Whether the build can train on a GPU.
    pub fn has_gpu_support(self) -> bool {
        self != Build::Cpu
    }
}

/// One GPU, as NVML reports it; a value NVML cannot read is `None`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// NVML's index (`cuda:N` in CUDA's default order).
    pub index: u32,
    /// Its name ("NVIDIA GeForce RTX 4090").
    pub name: String,
    /// Total device memory, bytes.
    pub memory_total_bytes: Option<u64>,
    /// Memory in use (by any process), bytes.
    pub memory_used_bytes: Option<u64>,
    /// Memory free, bytes.
    pub memory_free_bytes: Option<u64>,
    /// The PCIe generation the link runs at now (it drops when idle).
    pub pcie_generation: Option<u32>,
    /// The PCIe lanes the link runs with now.
    pub pcie_width: Option<u32>,
    /// The most the GPU and its slot support.
    pub pcie_max_generation: Option<u32>,
    /// The most lanes the GPU and its slot support.
    pub pcie_max_width: Option<u32>,
    /// CUDA compute capability, "major.minor" ("8.9" for an RTX 4090, "9.0" for an H100).
    pub compute_capability: Option<String>,
    /// Whether it multiplies fp8 on its tensor cores (compute capability 8.9 or newer): where
    /// `--precision fp8` and `tune --allow-fp8` run.
    pub fp8_tensor_cores: Option<bool>,
}

/// The host's memory, from `/proc/meminfo` where the platform has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HostMemory {
    /// Installed memory, bytes.
    pub total_bytes: Option<u64>,
    /// Memory available to a new process without swapping, bytes.
    pub available_bytes: Option<u64>,
}

impl HostMemory {
    /// Reads `/proc/meminfo`.
    pub fn read() -> Self {
        let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        Self::parse(&text)
    }

    /// Reads a `/proc/meminfo` text (`MemTotal:  32768000 kB`).
    pub fn parse(meminfo: &str) -> Self {
        let field = |name: &str| {
            let line = meminfo.lines().find(|l| l.starts_with(name))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            kib.checked_mul(1024)
        };
        Self {
            total_bytes: field("MemTotal:"),
            available_bytes: field("MemAvailable:"),
        }
    }
}

/// The report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Machine {
    /// What the binary was built for.
    pub build: Build,
    /// The GPUs NVML sees (none in a CPU build).
    pub gpus: Vec<Gpu>,
    /// The driver's version (a CUDA build with NVML).
    pub driver: Option<String>,
    /// The CUDA version the driver supports ("12.4").
    pub cuda: Option<String>,
    /// Why no GPU is listed, when none is.
    pub note: Option<String>,
    /// The host's memory.
    pub host: HostMemory,
}

impl Machine {
    /// Detects this machine. Nothing here fails: what cannot be read is absent, and `note`
    /// says why when no GPU is listed.
    pub fn detect() -> Self {
        let build = Build::current();
        let mut machine = Machine {
            build,
            gpus: Vec::new(),
            driver: None,
            cuda: None,
            note: None,
            host: HostMemory::read(),
        };
        if !build.has_gpu_support() {
            machine.note = Some(
                "this build has no GPU support; rebuild with `cargo build --release --features cuda`"
                    .into(),
            );
            return machine;
        }
        #[cfg(feature = "cuda")]
        nvml_gpus(&mut machine);
        machine
    }
}

/// Fills in the GPUs, driver and CUDA version from NVML.
#[cfg(feature = "cuda")]
fn nvml_gpus(machine: &mut Machine) {
    let nvml = match nvml_wrapper::Nvml::init() {
        Ok(nvml) => nvml,
        Err(e) => {
            machine.note = Some(format!(
                "NVML is unavailable ({e}): no NVIDIA driver, or no GPU in this machine"
            ));
            return;
        }
    };
    machine.driver = nvml.sys_driver_version().ok();
    machine.cuda = nvml
        .sys_cuda_driver_version()
        .ok()
        .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10));
    let count = nvml.device_count().unwrap_or(0);
    for index in 0..count {
        let Ok(device) = nvml.device_by_index(index) else {
            continue;
        };
        let memory = device.memory_info().ok();
        let capability = device.cuda_compute_capability().ok();
        machine.gpus.push(Gpu {
            index,
            name: device.name().unwrap_or_else(|_| "unknown".into()),
            memory_total_bytes: memory.as_ref().map(|m| m.total),
            memory_used_bytes: memory.as_ref().map(|m| m.used),
            memory_free_bytes: memory.as_ref().map(|m| m.free),
            pcie_generation: device.current_pcie_link_gen().ok(),
            pcie_width: device.current_pcie_link_width().ok(),
            pcie_max_generation: device.max_pcie_link_gen().ok(),
            pcie_max_width: device.max_pcie_link_width().ok(),
            compute_capability: capability
                .as_ref()
                .map(|c| format!("{}.{}", c.major, c.minor)),
            fp8_tensor_cores: capability
                .as_ref()
                .map(|c| crate::spec::device::has_fp8_tensor_cores_at(c.major, c.minor)),
        });
    }
    if machine.gpus.is_empty() {
        machine.note = Some("NVML sees no GPU".into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_reads_total_and_available_in_bytes() {
        let host = HostMemory::parse(
            "MemTotal:       32768000 kB\nMemFree:         1000 kB\nMemAvailable:   16384000 kB\n",
        );
        assert_eq!(host.total_bytes, Some(32_768_000 * 1024));
        assert_eq!(host.available_bytes, Some(16_384_000 * 1024));
        let none = HostMemory::parse("nonsense");
        assert_eq!((none.total_bytes, none.available_bytes), (None, None));
    }

    #[test]
    fn the_build_says_what_it_can_run_on() {
        assert_eq!(Build::current().has_gpu_support(), cfg!(feature = "cuda"));
        if !cfg!(feature = "cuda") {
            let machine = Machine::detect();
            assert!(machine.gpus.is_empty());
            assert!(machine.note.unwrap().contains("no GPU support"));
        }
    }
}
