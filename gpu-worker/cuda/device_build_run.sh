#!/bin/bash
# Builds, tests and benchmarks the CUDA module in one run on a GPU machine that has CUDA, CMake,
# ninja and g++ but none of pinfer's other build dependencies. Those come from a prefix packed on
# a Debian 12 machine by make_device_sdk.sh. The freshly built module, op tests, backend test and
# benchmarks are gathered into a bundle and handed to device_run.sh, so this run and a run of a
# bundle built elsewhere execute exactly the same steps. Run from the repository root:
#
#   gpu-worker/cuda/make_device_sdk.sh .device/sdk                       # on the Debian machine
#   gpu-worker/cuda/device_build_run.sh .device/sdk [OUT_DIR]            # on the GPU machine
#
# BUILD_DIR (default /tmp/pinfer-cuda-build) keeps the build; BENCH_DTYPES, BENCH_FLAGS and the
# timeouts pass through to device_run.sh.
set -euo pipefail
sdk=$(realpath "${1:?sdk dir from make_device_sdk.sh}")
out=${2:-${OUT:-./cuda-results}}
build=${BUILD_DIR:-/tmp/pinfer-cuda-build}
mkdir -p "$out"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
echo "== configure ($("$nvcc" --version | tail -1), $(cmake --version | head -1), $(g++ --version | head -1))"
start=$(date +%s)
while read -r file soname devname; do
  ln -sf "$file" "$sdk/usr/lib/x86_64-linux-gnu/$soname"
  ln -sf "$file" "$sdk/usr/lib/x86_64-linux-gnu/$devname"
done < "$sdk/links.txt"
cmake -G Ninja -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$sdk/usr" \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DPINFER_CUDA=ON -DPINFER_SERVICE=OFF > "$out/configure.log" 2>&1 ||
  { tail -50 "$out/configure.log"; exit 1; }
# gtest_discover_tests runs the test executables during the build.
export LD_LIBRARY_PATH="$sdk/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
echo "== build"
ninja -C "$build" pinfer_spm gpu-worker/cuda/all tests/cuda/all bench/cuda/all > "$out/build.log" 2>&1 ||
  { tail -80 "$out/build.log"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"

bundle="$build/device-bundle"
rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib"
find "$build/tests/cuda" "$build/bench/cuda" -maxdepth 1 -type f -executable -exec cp {} "$bundle/bin/" \;
cp "$build/gpu-worker/cuda/libpinfer_cuda.so" "$bundle/bin/"
cp "$(find "$build" -name libpinfer_spm.so -print -quit)" "$bundle/lib/"
ln -s "$sdk"/usr/lib/x86_64-linux-gnu/*.so* "$bundle/lib/"
exec "$(dirname "$0")/device_run.sh" "$bundle" "$out"
