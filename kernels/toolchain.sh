#!/usr/bin/env bash
# Installs a CUDA 13.0 build toolchain without a system CUDA toolkit or a GPU, from PyPI
# wheels only, and prints the environment a `--features cuda` (or `nccl`, `flash-attn`) build
# needs.
#
#   source <(bash kernels/toolchain.sh [DIR])   # default DIR: $HOME/.cache/stepppo-cuda
#   cargo build --release --features cuda
#
# Every wheel is pinned to one CUDA 13.0 release: a newer nvvm emits PTX that the 13.0
# ptxas rejects and that driver 580 (the lent H200 machines) cannot load. The link folder
# holds unversioned symlinks to the wheels' libraries and a link-time stand-in libcuda.so
# (SONAME libcuda.so.1) whose symbols are the driver entry points cudarc binds; at run time
# the GPU machine's real driver library is loaded instead. The stand-in is never shipped.
# For `flash-attn`, candle-flash-attn's build wants CUTLASS v3.5.0 as a git checkout; the
# `nvidia-cutlass` wheel of that release holds the same headers, laid out here as the checkout
# its builder looks for, and its 53 compiled kernels (about 80 minutes on 2 cores) are kept in
# DIR/flash-attn-build, so later builds take seconds.
set -euo pipefail
dir=${1:-${STEPPPO_CUDA_HOME:-$HOME/.cache/stepppo-cuda}}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
venv=$dir/venv
wheels=(
  nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
  nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35
  nvidia-nccl-cu13==2.28.9 nvidia-cutlass==3.5.0.0
)
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${wheels[@]}" >&2
cu13=$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13"))')
[ -x "$cu13/bin/nvcc" ] || { echo "toolchain.sh: nvcc not found under $cu13/bin" >&2; exit 1; }

root=$dir/cuda-root
mkdir -p "$root/lib"
ln -sfn "$cu13/bin" "$root/bin"
ln -sfn "$cu13/include" "$root/include"
ln -sfn "$cu13/nvvm" "$root/nvvm"
for lib in "$cu13"/lib/lib*.so.*; do
  base=$(basename "$lib")
  ln -sfn "$lib" "$root/lib/${base%%.so.*}.so"
done
# NCCL for `--features nccl`: 2.28.9 is the release PyTorch 2.11 (cu130) pins, so the GPU
# machine's libnccl.so.2 is the one this build binds (cudarc's `nccl-02028`).
nccl=$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "nccl", "lib"))')
[ -e "$nccl/libnccl.so.2" ] || { echo "toolchain.sh: libnccl.so.2 not found under $nccl" >&2; exit 1; }
ln -sfn "$nccl/libnccl.so.2" "$root/lib/libnccl.so"

# CUTLASS where candle-flash-attn's builder (cudaforge) finds its pinned commit checked out.
cutlass_commit=7d49e6c7e2f8896c47f586706e67e1fb215529dc
checkout=$dir/cudaforge/git/checkouts/cutlass-${cutlass_commit:0:16}
if [ ! -s "$checkout/.git/HEAD" ]; then
  cutlass_src=$("$venv/bin/python" -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source"))')
  mkdir -p "$checkout/tools/util"
  cp -r "$cutlass_src/include" "$checkout/include"
  cp -r "$cutlass_src/tools/util/include" "$checkout/tools/util/include"
  git init -q "$checkout"
  echo "$cutlass_commit" > "$checkout/.git/HEAD"
fi
mkdir -p "$dir/flash-attn-build"

# Link-time stand-in for the driver library: one dummy definition per cu* symbol that
# cudarc's driver bindings declare (read from the cudarc sources cargo downloaded).
cudarc_src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$cudarc_src" ]; then
  (cd "$(dirname "$0")/.." && cargo fetch -q >&2)
  cudarc_src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* | sort -V | tail -n 1)
fi
grep -hoE 'fn cu[A-Za-z0-9_]+\(' "$cudarc_src/src/driver/sys/mod.rs" \
  | sed -e 's/^fn //' -e 's/($//' | sort -u | sed 's/.*/void &(void) {}/' > "$dir/libcuda_stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/libcuda.so" "$dir/libcuda_stub.c"

cat <<ENV
export PATH="$root/bin:\$PATH"
export CUDA_ROOT="$root"
export CUDA_PATH="$root"
export CUDA_COMPUTE_CAP=90
export CUDAFORGE_THREADS=\${CUDAFORGE_THREADS:-2}
export CUDAFORGE_HOME="$dir/cudaforge"
export CANDLE_FLASH_ATTN_BUILD_DIR="$dir/flash-attn-build"
export LIBRARY_PATH="$root/lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
ENV
