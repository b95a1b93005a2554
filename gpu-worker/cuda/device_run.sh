#!/bin/bash
# One run on a GPU machine: op tests, the module's end-to-end test, then the decode benchmark in
# F16 and Q4_0 (one sequence, dense layer offload, the whole model; then two lanes). Run from the repository root with a bundle made by make_bundle.sh (the GPU machine
# needs only the NVIDIA driver and CUDA 13's cuBLAS):
#
#   gpu-worker/cuda/device_run.sh BUNDLE_DIR [OUT_DIR]
#
# Logs and gtest XML go to OUT_DIR (default ./cuda-results). The bench flags are the documented
# configuration of docs/benchmarks.md; extra BENCH_FLAGS are appended. Each bench process runs its
# modes ROUNDS times over (default 3) and ends with their medians, since single runs on a shared
# host move by 10-15% and now and then by 2x.
set -uo pipefail
bundle=$(realpath "${1:?bundle dir}")
out=${2:-${OUT:-./cuda-results}}
mkdir -p "$out"
cublas=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
  if [[ -e $d/libcublas.so.13 ]]; then cublas=$d; break; fi
done
if [[ -z $cublas ]]; then
  cublas=$(dirname "$(find / -name 'libcublas.so.13' -not -path '/proc/*' 2>/dev/null | head -1)")
fi
export LD_LIBRARY_PATH="$bundle/lib:$cublas:${LD_LIBRARY_PATH:-}"
echo "cuBLAS from $cublas"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
nproc; grep -m1 'model name' /proc/cpuinfo
rc=0
timeout "${OPS_TIMEOUT:-120}" "$bundle/bin/cuda_ops_test" --gtest_output="xml:$out/cuda_ops_test.xml" 2>&1 | tee "$out/cuda_ops_test.log" || rc=1
PINFER_CUDA_MODULE="$bundle/bin/libpinfer_cuda.so" PINFER_MODELS_DIR="$PWD/models" \
  timeout "${BACKEND_TIMEOUT:-120}" "$bundle/bin/cuda_backend_test" --gtest_output="xml:$out/cuda_backend_test.xml" 2>&1 | tee "$out/cuda_backend_test.log" || rc=1
for dtype in ${BENCH_DTYPES-F16 Q4_0}; do  # BENCH_DTYPES="": the tests alone
  timeout "${BENCH_TIMEOUT:-240}" "$bundle/bin/cuda_decode_bench" --dtype=$dtype --rounds=${ROUNDS:-3} ${BENCH_FLAGS:-} 2>&1 | tee "$out/bench_$dtype.log" || rc=1
done
# Two sequences in flight (lanes), each filling the other's gaps between the two sides, in a
# process of their own: a lane's KV slot comes out of the hot rows, which the one-sequence rows
# above keep (LANES_DTYPES="" skips it; the bench's flags apply, then --modes=lanes).
for dtype in ${LANES_DTYPES-F16 Q4_0}; do
  timeout "${BENCH_TIMEOUT:-240}" "$bundle/bin/cuda_decode_bench" --dtype=$dtype --rounds=${ROUNDS:-3} ${BENCH_FLAGS:-} --modes=lanes 2>&1 | tee "$out/lanes_$dtype.log" || rc=1
done
# Prompt processing, cold rows on the CPU vs streamed vs the cost model's choice (opt-in:
# PREFILL_DTYPES="F16 Q4_0"; PREFILL_FLAGS are appended).
for dtype in ${PREFILL_DTYPES:-}; do
  timeout "${BENCH_TIMEOUT:-240}" "$bundle/bin/cuda_prefill_bench" --dtype=$dtype ${PREFILL_FLAGS:-} 2>&1 | tee "$out/prefill_$dtype.log" || rc=1
done
# Adaptive hot set against the static placement (opt-in: ADAPTIVE_DTYPES="F16"; ADAPTIVE_FLAGS).
for dtype in ${ADAPTIVE_DTYPES:-}; do
  timeout "${BENCH_TIMEOUT:-240}" "$bundle/bin/cuda_adaptive_bench" --dtype=$dtype ${ADAPTIVE_FLAGS:-} 2>&1 | tee "$out/adaptive_$dtype.log" || rc=1
done
exit $rc
