//! Choosing the compute device from a user string (`cpu`, `cuda`, `cuda:N`), and the
//! process-wide settings CPU training runs under ([`prepare_cpu_process`]). Asking for CUDA in
//! a build without the `cuda` feature is an error that says how to rebuild, never a silent CPU
//! fallback. Also how much memory a run may grow into ([`memory_available`]).

use candle_core::Device;

/// How long an idle worker of candle's barrier pool spins before it parks, in spin-loop hints
/// (candle's default: 25,000). Spinning idle workers hold a core the busy ones need wherever
/// threads outnumber free cores (candle's pool, rayon's and the caller on a 2-core machine):
/// the `small` update at 8 × 128 on two threads took 41 ms at the default and 29–30 ms at 200.
const BARRIER_POOL_SPIN_LIMIT: &str = "200";

/// Process-wide settings of CPU training, applied once at the start of a process, before any
/// other thread or tensor exists:
/// - glibc's allocator serves every allocation from its heap and keeps freed memory for reuse.
///   By default each allocation above 32 MB (a training attention matrix is hundreds of MB) is
///   a fresh `mmap` that the kernel zeroes page by page on first touch and unmaps on free; the
///   heap stays at the run's peak size, which the run reaches anyway;
/// - candle's barrier-pool workers spin briefly before they park
///   ([`BARRIER_POOL_SPIN_LIMIT`]), unless `CANDLE_BARRIER_POOL_SPIN_LIMIT` is set.
pub fn prepare_cpu_process() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only changes allocator tunables; it is called before any other thread
    // exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
    }
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", BARRIER_POOL_SPIN_LIMIT);
    }
}

/// Errors of device selection.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("unknown device {0:?}: expected cpu, cuda or cuda:N")]
    Unknown(String),
    #[error("device {0:?} needs a CUDA build: rebuild with `cargo build --release --features cuda` (see docs/guides/cuda.md)")]
    NotBuilt(String),
    #[error("device {name:?}: {source}")]
    Unavailable {
        name: String,
        #[source]
        source: candle_core::Error,
    },
}

/// The device named by `name`.
pub fn parse_device(name: &str) -> Result<Device, DeviceError> {
    let lower = name.trim().to_ascii_lowercase();
    if lower == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = match lower.strip_prefix("cuda") {
        Some("") => 0,
        Some(rest) => rest
            .strip_prefix(':')
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| DeviceError::Unknown(name.into()))?,
        None => return Err(DeviceError::Unknown(name.into())),
    };
    cuda_device(name, ordinal)
}

#[cfg(feature = "cuda")]
fn cuda_device(name: &str, ordinal: usize) -> Result<Device, DeviceError> {
    Device::new_cuda(ordinal).map_err(|source| DeviceError::Unavailable {
        name: name.into(),
        source,
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(name: &str, _ordinal: usize) -> Result<Device, DeviceError> {
    Err(DeviceError::NotBuilt(name.into()))
}

/// Bytes of memory this process may grow into on `device`, counting what it holds already:
/// on the CPU the kernel's `MemAvailable` plus the process's resident set, capped by the
/// cgroup's `memory.max` when one is set. `None` where it is not known (non-Linux, CUDA: not
/// queried yet).
pub fn memory_available(device: &Device) -> Option<u64> {
    if !device.is_cpu() {
        return None;
    }
    let kib = |text: &str, key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        let value = line[key.len()..].trim().trim_end_matches("kB").trim();
        value.parse::<u64>().ok().map(|k| k * 1024)
    };
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let resident = kib(&status, "VmRSS:").unwrap_or(0);
    let available = kib(&meminfo, "MemAvailable:")? + resident;
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    let used = std::fs::read_to_string("/sys/fs/cgroup/memory.current")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    Some(match (cgroup, used) {
        (Some(max), Some(used)) => available.min(max.saturating_sub(used) + resident),
        _ => available,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_parses_and_garbage_is_named() {
        assert!(parse_device("cpu").unwrap().is_cpu());
        assert!(parse_device(" CPU ").unwrap().is_cpu());
        let err = parse_device("tpu").unwrap_err().to_string();
        assert!(err.contains("\"tpu\""), "{err}");
        assert!(parse_device("cuda:x").is_err());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_rebuild() {
        let err = parse_device("cuda").unwrap_err().to_string();
        assert!(err.contains("--features cuda"), "{err}");
    }
}
