#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything the GPU check needs and packs it into .gpu/
# (git-ignored): the `stepppo` binary, the CUDA test binaries, the library's unit tests and the
# update bench (`training`), built with `--features nccl,flash-attn` (everything the check
# exercises; FEATURES picks others, e.g. `cuda`), packed into one xz archive
# (.gpu/bins.tar.xz) whose dictionary spans more than a binary: every
# binary links the same ~290 MB of candle's and flash-attention's kernels, which the archive then
# stores once (four binaries: 126 MB as separate .xz files, over the 64 MiB a device call
# carries). The first build with `flash-attn` compiles its 53 kernels, about 80 minutes on 2
# cores; kernels/toolchain.sh keeps them for every later build. A build with `nccl` (or
# `mpi`) also carries the `dist_mpi` test and, in .gpu/debs, Debian bookworm's Open MPI runtime
# packages with the libraries they load that a base system lacks: the GPU machine has no MPI,
# and scripts/gpu_check.sh unpacks them there. Carry `.gpu` to the GPU machine and run
# `bash scripts/gpu_check.sh` there (see docs/guides/cuda.md).
set -euo pipefail
cd "$(dirname "$0")/.."
features=${FEATURES:-nccl,flash-attn}
with_mpi=
case ",$features," in *,mpi,*|*,nccl,*) with_mpi=1 ;; esac
# Open MPI 4.1's runtime (`libopenmpi3`, `mpirun` from `openmpi-bin`, help texts and settings
# from `openmpi-common`) and the closure of its library dependencies, less glibc, libstdc++,
# libgcc, zlib and libuuid (every base system has them) and less the optional hwloc plugins
# (`libhwloc-plugins` would bring X11, libxml2 and ICU for topology sources a run does without).
mpi_debs=(
  libopenmpi3 openmpi-bin openmpi-common libpmix2 libhwloc15 libevent-core-2.1-7
  libevent-pthreads-2.1-7 libfabric1 libibverbs1 ibverbs-providers librdmacm1 libnl-3-200
  libnl-route-3-200 libpsm2-2 libpsm-infinipath1 libucx0 libnuma1 libmunge2 libatomic1 libudev1
)
if [ -n "$with_mpi" ] && ! command -v apt-get >/dev/null; then
  echo "build_gpu_bundle.sh: FEATURES=$features needs apt-get (Debian bookworm) to fetch Open MPI's packages" >&2
  exit 1
fi
source <(bash kernels/toolchain.sh)
mkdir -p .gpu
exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
cargo build --release --features "$features"
# The test binaries, each with the name it runs under there: the `cuda_*` tests, the library's
# unit tests (`lib_tests`; the GPU check runs those named `on_cuda`) and `dist_mpi`.
only=(--lib --test 'cuda_*')
[ -n "$with_mpi" ] && only+=(--test dist_mpi)
tests=$(cargo test --release --features "$features" "${only[@]}" --no-run --message-format=json \
  | WITH_MPI=$with_mpi python3 -c 'import json, os, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    name, kind = m["target"]["name"], m["target"]["kind"]
    if "lib" in kind:
        name = "lib_tests"
    elif not (name.startswith("cuda_") or (name == "dist_mpi" and os.environ["WITH_MPI"])):
        continue
    print(m["executable"], name)')
# The update bench (stepppo's update next to PyTorch's on the GPU).
bench=$(cargo bench --features "$features" --bench training --no-run --message-format=json \
  | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "training":
        print(m["executable"])')
rm -rf .gpu/*
mkdir .gpu/bin
cp "${CARGO_TARGET_DIR:-target}/release/stepppo" .gpu/bin/stepppo
cp "$bench" .gpu/bin/training
while read -r exe name; do cp "$exe" ".gpu/bin/$name"; done <<< "$tests"
strip .gpu/bin/*
# One thread: xz's threads compress blocks independently, and the repeats lie a binary apart.
tar cf - -C .gpu/bin . | xz -T1 --lzma2=preset=6,dict=512MiB > .gpu/bins.tar.xz
rm -rf .gpu/bin
if [ -n "$with_mpi" ]; then
  mkdir .gpu/debs
  (cd .gpu/debs && { apt-get download -qq "${mpi_debs[@]}" \
    || { apt-get update -qq && apt-get download -qq "${mpi_debs[@]}"; }; })
fi
ls -la .gpu .gpu/debs 2>/dev/null || true
du -sh .gpu
