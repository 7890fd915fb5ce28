//! Choosing the compute device from a user string (`cpu`, `cuda`, `cuda:N`), and the
//! process-wide settings CPU training runs under ([`prepare_cpu_process`]). Asking for CUDA in
//! a build without the `cuda` feature is an error that says how to rebuild, never a silent CPU
//! fallback. Also how much memory a run may grow into ([`memory_available`]) and the most it
//! held since a point ([`memory_peak`], [`reset_memory_peak`]).

use std::sync::OnceLock;

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
///   ([`BARRIER_POOL_SPIN_LIMIT`]), unless `CANDLE_BARRIER_POOL_SPIN_LIMIT` is set;
/// - the compute thread count is fixed once: `RAYON_NUM_THREADS`, unless the user set it, becomes
///   the count candle would choose (the physical cores). Unset, candle works that count out
///   again for every matrix product, reading `/proc/cpuinfo` each time: 2.4 ms of each 8-token
///   decode call of the `small` model went there, more when the machine is busy. `cpu_threads`
///   ([`set_cpu_threads`]) may still change it; the user's variable is never changed.
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
    if !user_set_threads() {
        let threads = candle_core::utils::get_num_threads();
        std::env::set_var(THREADS_VAR, threads.to_string());
    }
}

/// The variable candle's and rayon's thread counts read.
const THREADS_VAR: &str = "RAYON_NUM_THREADS";

/// Whether the user's environment named the thread count when it was first asked (before
/// [`prepare_cpu_process`] sets a default).
fn user_set_threads() -> bool {
    static USER_SET: OnceLock<bool> = OnceLock::new();
    *USER_SET.get_or_init(|| std::env::var_os(THREADS_VAR).is_some())
}

/// Applies a config's `cpu_threads` (0: keep the default) unless the user's environment named
/// the thread count (`RAYON_NUM_THREADS`, read by candle and rayon).
pub fn set_cpu_threads(n: usize) {
    if n > 0 && !user_set_threads() {
        std::env::set_var(THREADS_VAR, n.to_string());
    }
}

/// Errors of device selection.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A name that is none of `cpu`, `cuda`, `cuda:N` (the name as given).
    #[error("unknown device {0:?}: expected cpu, cuda or cuda:N")]
    Unknown(String),
    /// A CUDA device asked of a build without the `cuda` feature (the name as given).
    #[error("device {0:?} needs a CUDA build: rebuild with `cargo build --release --features cuda` (see docs/guides/cuda.md)")]
    NotBuilt(String),
    /// The CUDA device could not be opened.
    #[error("device {name:?}: {source}")]
    Unavailable {
        /// The device name as given.
        name: String,
        /// candle's error opening it.
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
/// - on the CPU, the kernel's `MemAvailable` plus the process's resident set, capped by the
///   cgroup's `memory.max` when one is set;
/// - on CUDA, the device's free memory plus what the memory pool candle allocates from
///   (`cuMemAllocAsync`'s) holds for this process.
///
/// `None` where it is not known (non-Linux, a CUDA driver without stream-ordered allocation).
pub fn memory_available(device: &Device) -> Option<u64> {
    if !device.is_cpu() {
        return cuda_memory::available(device);
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let resident = proc_status_bytes("VmRSS:").unwrap_or(0);
    let available = kib_field(&meminfo, "MemAvailable:")? + resident;
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

/// The most memory this process held on `device` since the last [`reset_memory_peak`] (or its
/// start): on the CPU the resident set's high-water mark (`VmHWM`), on CUDA the high-water mark
/// of bytes in use in the memory pool candle allocates from (what PyTorch calls
/// `max_memory_allocated`). `None` where it is not known.
pub fn memory_peak(device: &Device) -> Option<u64> {
    if device.is_cpu() {
        proc_status_bytes("VmHWM:")
    } else {
        cuda_memory::peak(device)
    }
}

/// Starts a new [`memory_peak`] window on `device`: on the CPU the kernel sets the resident
/// set's high-water mark to the current resident set (`/proc/self/clear_refs`), on CUDA the pool's
/// high-water mark to the bytes in use now. Where that cannot be done, the peak keeps counting
/// from the earlier start.
pub fn reset_memory_peak(device: &Device) {
    if device.is_cpu() {
        // Writing 5 resets the peak resident set size (Linux 4.0 on); nothing else is touched.
        let _ = std::fs::write("/proc/self/clear_refs", "5");
    } else {
        cuda_memory::reset_peak(device);
    }
}

/// A `kB` field of `/proc/self/status` in bytes.
fn proc_status_bytes(key: &str) -> Option<u64> {
    kib_field(&std::fs::read_to_string("/proc/self/status").ok()?, key)
}

/// The value of a `KEY: N kB` line of a `/proc` file, in bytes.
fn kib_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let value = line[key.len()..].trim().trim_end_matches("kB").trim();
    value.parse::<u64>().ok().map(|k| k * 1024)
}

/// CUDA's side of the memory queries: candle allocates through cudarc's `cuMemAllocAsync`, from
/// the device's current memory pool, whose attributes count this process's bytes in use (and
/// their high-water mark) and the bytes it reserves from the device.
#[cfg(feature = "cuda")]
mod cuda_memory {
    use candle_core::cuda_backend::cudarc::driver::{sys, CudaContext};
    use candle_core::Device;
    use std::sync::Arc;

    use sys::CUmemPool_attribute::{
        CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, CU_MEMPOOL_ATTR_USED_MEM_HIGH,
    };

    /// The context of a CUDA `device` and the pool its allocations come from.
    fn pool(device: &Device) -> Option<(Arc<CudaContext>, sys::CUmemoryPool)> {
        let ctx = device
            .as_cuda_device()
            .ok()?
            .cuda_stream()
            .context()
            .clone();
        if !ctx.has_async_alloc() {
            return None;
        }
        ctx.bind_to_thread().ok()?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer; the device handle comes from a live context.
        unsafe { sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device()) }
            .result()
            .ok()?;
        Some((ctx, pool))
    }

    fn attribute(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute) -> Option<u64> {
        let mut value: u64 = 0;
        // SAFETY: both attributes read here are `cuuint64_t`, written to `value`.
        unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut value as *mut u64).cast()) }
            .result()
            .ok()?;
        Some(value)
    }

    pub(super) fn available(device: &Device) -> Option<u64> {
        let (ctx, pool) = pool(device)?;
        let (free, _total) = ctx.mem_get_info().ok()?;
        Some(free as u64 + attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?)
    }

    pub(super) fn peak(device: &Device) -> Option<u64> {
        let (_ctx, pool) = pool(device)?;
        attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    }

    pub(super) fn reset_peak(device: &Device) {
        if let Some((_ctx, pool)) = pool(device) {
            let mut zero: u64 = 0;
            // SAFETY: the high-water mark is a `cuuint64_t` and may only be set to 0, which
            // restarts it from the bytes in use now.
            let _ = unsafe {
                sys::cuMemPoolSetAttribute(
                    pool,
                    CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    (&mut zero as *mut u64).cast(),
                )
            };
        }
    }
}

/// Without the `cuda` feature no CUDA device exists to ask.
#[cfg(not(feature = "cuda"))]
mod cuda_memory {
    use candle_core::Device;

    pub(super) fn available(_: &Device) -> Option<u64> {
        None
    }

    pub(super) fn peak(_: &Device) -> Option<u64> {
        None
    }

    pub(super) fn reset_peak(_: &Device) {}
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

    #[test]
    fn proc_fields_read_in_bytes() {
        let status = "Name:\tstepppo\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n";
        assert_eq!(kib_field(status, "VmHWM:"), Some(200 << 20));
        assert_eq!(kib_field(status, "VmSwap:"), None);
        assert!(memory_peak(&Device::Cpu).expect("Linux reports VmHWM") > 0);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_rebuild() {
        let err = parse_device("cuda").unwrap_err().to_string();
        assert!(err.contains("--features cuda"), "{err}");
    }
}
