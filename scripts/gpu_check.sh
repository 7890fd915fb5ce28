#!/usr/bin/env bash
# Runs the CUDA checks on a GPU machine from the repository root, with the `.gpu` bundle made by
# scripts/build_gpu_bundle.sh (no Rust toolchain needed there). Writes every result into
# ${OUT:-gpu-results}: the GPU tests, the decode kernel's bandwidth against a device copy,
# stepppo's rollout throughput with the radix cache vs without it, and Hugging Face
# transformers `generate` on the same workload (Qwen2.5-0.5B shape, random bf16 weights). A
# bundle built with `nccl` also brings Open MPI's Debian packages (.gpu/debs): they are unpacked
# under /tmp/mpiroot and relocated there (the machine has no MPI), and the `dist_mpi` test runs as
# one rank under that `mpirun`, its gradient summed by NCCL on the GPU. ONLY=dist stops after it.
set -uo pipefail
out=${OUT:-gpu-results}
mkdir -p "$out" /tmp/stepppo-gpu
for f in .gpu/*.xz; do xz -dc "$f" > "/tmp/stepppo-gpu/$(basename "$f" .xz)"; done
chmod +x /tmp/stepppo-gpu/*
libs=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null || true)
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH="${libs}${nccl:+:$nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ -d .gpu/debs ]; then
  # Open MPI from the Debian packages, relocated: OPAL_DESTDIR and PMIX_DESTDIR put the root in
  # front of every installed path (plugins, help texts, settings); PMIx's settings name its
  # plugin folder absolutely, so that one is given again. The two links are what the packages'
  # maintainer scripts (update-alternatives) would have made.
  mpiroot=/tmp/mpiroot
  rm -rf "$mpiroot"
  for f in .gpu/debs/*.deb; do dpkg -x "$f" "$mpiroot"; done
  mlib=$mpiroot/usr/lib/x86_64-linux-gnu
  ln -sf ../libpsm1/libpsm_infinipath.so.1.16 "$mlib/libpsm_infinipath.so.1"
  ln -sf orterun "$mpiroot/usr/bin/mpirun"
  export PATH="$mpiroot/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$mlib:$mlib/openmpi/lib:$mlib/ucx:$mpiroot/lib/x86_64-linux-gnu"
  export OPAL_DESTDIR=$mpiroot PMIX_DESTDIR=$mpiroot
  export PMIX_MCA_mca_base_component_path=$mlib/pmix2/lib/pmix
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
bin=/tmp/stepppo-gpu/stepppo
spec=${SPEC:-gpu_group:8,8,4,1024,64,64}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
if [ -x /tmp/stepppo-gpu/dist_mpi ] && command -v mpirun >/dev/null; then
  ldd /tmp/stepppo-gpu/dist_mpi > "$out/dist_mpi-ldd.txt" 2>&1
  grep 'not found' "$out/dist_mpi-ldd.txt"
  NCCL_DEBUG=${NCCL_DEBUG:-WARN} timeout 300 mpirun -np 1 /tmp/stepppo-gpu/dist_mpi --nocapture 2>&1 \
    | tee "$out/test-dist_mpi.log"
  [ "${ONLY:-}" = dist ] && exit 0
fi
for t in /tmp/stepppo-gpu/cuda_*; do
  "$t" --nocapture 2>&1 | tee "$out/test-$(basename "$t").log"
done
if command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck /tmp/stepppo-gpu/cuda_kernels 2>&1 | tail -n 20 | tee "$out/memcheck.log"
fi
"$bin" bench kernels --device cuda --json | tee "$out/kernels.jsonl"
"$bin" bench kernels --device cuda --batch 8 --context 32768 --json | tee -a "$out/kernels.jsonl"
"$bin" bench prefix --device cuda --model configs/models/qwen2.5-0.5b.json --spec "$spec" --json | tee "$out/prefix.jsonl"
python3 scripts/hf_rollout_bench.py --spec "$spec" --json | tee "$out/hf.jsonl"
