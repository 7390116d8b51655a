# Sourced by the CPU benchmarks' run.sh (bench/engine, bench/moe, bench/generator), with $root
# set: builds their binary in $build (a RelWithDebInfo bench build), installs Debian's
# python3-torch for the PyTorch peer when missing, and sets $coretype, the OpenBLAS kernels
# PyTorch's OpenBLAS is pointed at (OPENBLAS_CORETYPE), as kernels_cpu's loader picks for itself.

# build_bench TARGET
build_bench() {
  cmake -G Ninja -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRLH_BUILD_BENCH=ON \
    -DRLH_BUILD_TESTS=OFF >/dev/null
  ninja -C "$build" -j2 "$1" >/dev/null
}

if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
  echo "installing python3-torch (Debian) for the PyTorch peer"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq >/dev/null
  $SUDO apt-get install -y -qq python3-torch >/dev/null
fi
coretype=Haswell
grep -q avx512f /proc/cpuinfo && coretype=SkylakeX
