//! GPU tests of the device memory queries (feature `cuda`) that `memory/peak_gib` and the memory
//! plan's check read: the peak of bytes allocated counts a tensor and restarts at a reset, and the
//! memory a run may grow into counts what the process holds and stays within the device's total.
//! Without a CUDA device each test prints why it skipped and passes.
#![cfg(feature = "cuda")]

#[path = "common/cuda.rs"]
mod gpu;

use candle_core::{DType, Device, Tensor};
use gpu::cuda;
use stepppo::device::{memory_available, memory_peak, reset_memory_peak};

const BYTES: u64 = 256 << 20;

fn held(dev: &Device) -> Tensor {
    let t = Tensor::zeros(BYTES as usize / 4, DType::F32, dev).unwrap();
    dev.synchronize().unwrap();
    t
}

/// One test, so that no other allocation on the device runs between its readings.
#[test]
fn the_peak_and_the_memory_available_count_what_the_process_holds() {
    let Some(gpu) = cuda() else { return };
    let total = gpu
        .as_cuda_device()
        .unwrap()
        .cuda_stream()
        .context()
        .total_mem()
        .unwrap() as u64;
    reset_memory_peak(&gpu);
    let before = memory_peak(&gpu).expect("candle allocates from a pool with a peak");
    let tensor = held(&gpu);
    let during = memory_peak(&gpu).unwrap();
    assert!(during >= before + BYTES, "{during} < {before} + {BYTES}");
    let available = memory_available(&gpu).expect("the device reports its free memory");
    assert!(
        (BYTES..=total).contains(&available),
        "{available} outside {BYTES}..={total}"
    );
    drop(tensor);
    gpu.synchronize().unwrap();
    reset_memory_peak(&gpu);
    let after = memory_peak(&gpu).unwrap();
    assert!(after + BYTES <= during, "{after} + {BYTES} > {during}");
}
