#!/bin/bash
# Session 15's check of the dense int8 decode layer in one persistent launch (DenseLayerStep),
# with layer-kernel.patch applied to main: op and backend tests (the new
# DenseLayerInOneLaunchMatchesTheFiveCalls among them), then the whole Q4_0 model alternating
# with the five kernels (LAYER_KERNEL=0), then the spills of the phases in the SASS.
# first-run.log: the draft as session 14 left it; grid-constant-run.log: its parameters
# __grid_constant__ (as in the patch). phases.sh: the per-phase A/B (LAYER_STOP, LAYER_POLL).
# Run: copy to .device/lk.sh, then run with carry [".device/sdk", ".device/lk.sh"].
set -u
out=$1
BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=base;LAYER_KERNEL=0;base;LAYER_KERNEL=0" \
  timeout 420 gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/cuda_ops_test.log $out/cuda_backend_test.log; do grep -E "PASSED|FAILED|Failure" $f | head; done
cat $out/cuda_ops_test.log $out/cuda_backend_test.log | grep -E "(DenseLayer|QuantizedModelStep|WholeModel).*(OK|FAILED)|Failure|Expected|Which is|nmse" | head -20
for f in $out/bench_*.log; do grep -E "^\| |whole model" $f | grep -v "^| dtype\|^|---" | cut -c1-160; done
CU=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
$CU -sass /tmp/pinfer-cuda-build/gpu-worker/cuda/libpinfer_cuda.so 2>/dev/null |
  awk '/Function : /{name=$0} /STL|LDL/{n[name]++} END{for (k in n) if (k ~ /DenseLayer|QxRegsPhase|AttentionPhase/) print n[k], k}' | cut -c1-220
