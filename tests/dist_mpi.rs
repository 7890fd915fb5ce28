//! The MPI world for real: the launcher test starts this test binary as two ranks under `mpirun`,
//! each running only the worker test, which joins the world and checks every collective's
//! answer on its rank. Outside a launcher the worker passes without doing anything; under a
//! launcher the launcher test does nothing (so `mpirun -np N <this binary>` runs the worker on N
//! ranks). Built with `nccl` on a machine with a CUDA device per rank of the node, the worker
//! joins with NCCL and also sums gradients that live on its device. Needs the `mpi` feature and,
//! to run the ranks, `mpirun` on `PATH`.
#![cfg(feature = "mpi")]

use std::process::Command;

use candle_core::{Device, Tensor};
use stepppo::dist::{join_world, launcher_world_size};

/// The worker's name, as `--exact` wants it.
const WORKER: &str = "every_collective_gives_the_sum_gather_and_broadcast_on_each_rank";
/// What each rank prints when all its checks passed.
const PASSED: &str = "dist_mpi: rank passed";

#[test]
fn two_ranks_under_mpirun_agree_on_every_collective() {
    if launcher_world_size().is_some() {
        return;
    }
    if Command::new("mpirun").arg("--version").output().is_err() {
        println!("skipped: `mpirun` is not on PATH (install Open MPI: openmpi-bin)");
        return;
    }
    let mut mpirun = Command::new("mpirun");
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        mpirun.arg("--allow-run-as-root");
    }
    let out = mpirun
        .args(["--oversubscribe", "-np", "2"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", WORKER, "--nocapture", "--test-threads=1"])
        .output()
        .expect("start mpirun");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "mpirun failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    let passed = stdout.matches(PASSED).count();
    assert_eq!(
        passed, 2,
        "both ranks should report their checks:\n{stdout}\n{stderr}"
    );
}

#[test]
fn every_collective_gives_the_sum_gather_and_broadcast_on_each_rank() {
    let Some(n) = launcher_world_size() else {
        return;
    };
    let ordinal = cuda_ordinal();
    let world = join_world(ordinal).expect("join the MPI world");
    let (rank, size) = (world.rank(), world.size());
    let backend = if ordinal.is_some() { "mpi+nccl" } else { "mpi" };
    assert_eq!((size, world.backend()), (n, backend));
    assert!(rank < size);

    let mut f64s = [rank as f64 + 1.0, 2.0 * rank as f64];
    world.all_reduce_f64(&mut f64s).unwrap();
    let sum_ranks = (size * (size - 1) / 2) as f64;
    assert_eq!(f64s, [sum_ranks + size as f64, 2.0 * sum_ranks]);

    let mut f32s = [1.0f32, 0.5 * rank as f32];
    world.all_reduce_f32(&mut f32s).unwrap();
    assert_eq!(f32s, [size as f32, 0.5 * sum_ranks as f32]);

    // Rank r sends 3r bytes (rank 0 an empty buffer), each r + i.
    let part = |r: usize| (0..3 * r).map(|i| (r + i) as u8).collect::<Vec<u8>>();
    let gathered = world.all_gather_bytes(&part(rank)).unwrap();
    assert_eq!(gathered, (0..size).map(part).collect::<Vec<_>>());
    // Nothing from anyone, and an empty sum.
    assert_eq!(
        world.all_gather_bytes(&[]).unwrap(),
        vec![Vec::<u8>::new(); size]
    );
    world.all_reduce_f32(&mut []).unwrap();

    let mut bytes = match rank {
        0 => b"from rank 0".to_vec(),
        r => vec![r as u8; 100 * r],
    };
    world.broadcast_bytes(&mut bytes).unwrap();
    assert_eq!(bytes, b"from rank 0");

    let flat = Tensor::new(&[rank as f32, 1.0, -2.0], &Device::Cpu).unwrap();
    let summed = world.all_reduce_tensor(&flat).unwrap();
    let want = [sum_ranks as f32, size as f32, -2.0 * size as f32];
    assert_eq!(summed.to_vec1::<f32>().unwrap(), want);

    blocks_on(world.as_ref(), &Device::Cpu);
    #[cfg(feature = "nccl")]
    if let Some(ordinal) = ordinal {
        device_sums(world.as_ref(), ordinal);
        blocks_on(world.as_ref(), &Device::new_cuda(ordinal).unwrap());
    }

    world.barrier().unwrap();
    println!("{PASSED} {rank} of {size} ({backend})");
}

/// Reduce-scatter and all-gather of equal blocks (a sharded optimizer's), on the host and as
/// tensors on `dev`: rank r contributes `r + i` at position i of `size` blocks of 3, and receives
/// its block's sums; the gathered blocks come back in rank order.
fn blocks_on(world: &dyn stepppo::dist::Collective, dev: &Device) {
    let (rank, size) = (world.rank(), world.size());
    let mine: Vec<f32> = (0..3 * size).map(|i| (rank + i) as f32).collect();
    let sum_ranks = (size * (size - 1) / 2) as f32;
    let want: Vec<f32> = (3 * rank..3 * rank + 3)
        .map(|i| sum_ranks + (size * i) as f32)
        .collect();
    assert_eq!(world.reduce_scatter_f32(&mine).unwrap(), want);
    let t = Tensor::new(mine.as_slice(), dev).unwrap();
    let block = world.reduce_scatter_tensor(&t).unwrap();
    assert!(block.device().same_device(dev));
    assert_eq!(block.to_vec1::<f32>().unwrap(), want);
    let part = [rank as f32, -(rank as f32)];
    let all: Vec<f32> = (0..size).flat_map(|r| [r as f32, -(r as f32)]).collect();
    assert_eq!(world.all_gather_f32(&part).unwrap(), all);
    let gathered = world
        .all_gather_tensor(&Tensor::new(&part, dev).unwrap())
        .unwrap();
    assert_eq!(gathered.to_vec1::<f32>().unwrap(), all);
    if size > 1 {
        // Every rank sees the same length and refuses before MPI is called.
        let uneven = vec![1.0f32; 3 * size + 1];
        let err = world.reduce_scatter_f32(&uneven).unwrap_err().to_string();
        assert!(err.contains("equal blocks"), "{err}");
    }
}

/// This rank's CUDA device when every rank on the node has one: its node-local rank (as Open
/// MPI's `mpirun` numbers them).
#[cfg(feature = "nccl")]
fn cuda_ordinal() -> Option<usize> {
    let env = |k: &str| std::env::var(k).ok()?.parse::<usize>().ok();
    let (local, on_node) = (
        env("OMPI_COMM_WORLD_LOCAL_RANK")?,
        env("OMPI_COMM_WORLD_LOCAL_SIZE")?,
    );
    let gpus = cudarc::driver::CudaContext::device_count().ok()? as usize;
    (gpus >= on_node).then_some(local)
}

#[cfg(not(feature = "nccl"))]
fn cuda_ordinal() -> Option<usize> {
    None
}

/// NCCL's sums of gradients on the device: a small one, and a large one that starts inside its
/// buffer (a narrowed tensor), each summed on the device it came from.
#[cfg(feature = "nccl")]
fn device_sums(world: &dyn stepppo::dist::Collective, ordinal: usize) {
    let (rank, size) = (world.rank() as f32, world.size() as f32);
    let dev = Device::new_cuda(ordinal).expect("open this rank's CUDA device");
    let small = Tensor::new(&[rank, 1.0, -2.0], &dev).unwrap();
    let summed = world.all_reduce_tensor(&small).unwrap();
    assert!(summed.device().same_device(&dev));
    let ranks = size * (size - 1.0) / 2.0;
    assert_eq!(summed.to_vec1::<f32>().unwrap(), [ranks, size, -2.0 * size]);

    let n = 1 << 20;
    let big = Tensor::ones(n + 7, candle_core::DType::F32, &dev).unwrap();
    let big = (big * (rank as f64 + 1.0))
        .unwrap()
        .narrow(0, 7, n)
        .unwrap();
    let summed = world
        .all_reduce_tensor(&big)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let want = ranks + size;
    assert!(
        summed.len() == n && summed.iter().all(|&x| x == want),
        "sum {want} expected"
    );
}
