#!/bin/bash
# Session 31, first call: the op and backend tests with the adaptive hot set's counting thread
# (CudaBackendTest.AdaptiveCacheInPredictedModeMatchesCpuReference now runs both drivers), then
# the adaptive bench driven by the product's AdaptiveHotSet, counting between steps and in the
# background: F16 twice and Q4_0 once, one process each, as in the "Adaptive hot set" section.
# Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod, packed to .device/cudamod.tar.xz.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
for t in cuda_ops_test cuda_backend_test; do
  LD_LIBRARY_PATH=/tmp/s/cudamod/lib PINFER_CUDA_MODULE=$bin/libpinfer_cuda.so \
    PINFER_MODELS_DIR="$PWD/models" timeout 250 $bin/$t > $out/$t.log 2>&1
  echo "== $t: rc $? at $((SECONDS - start)) s"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran" $out/$t.log
  grep -B3 -A12 "Failure" $out/$t.log | head -40
done
grep -E "^\[ +(RUN|OK) +\] CudaBackendTest.Adaptive" $out/cuda_backend_test.log
for run in F16_1 Q4_0_1 F16_2; do
  d=${run%_*}
  LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 150 $bin/cuda_decode_bench \
    --dtype=$d --modes=adaptive --warmup=48 --steps=64 --cache-fractions=0.5,1.0 \
    > $out/adaptive_$run.log 2>&1
  echo "== adaptive $run: rc $? at $((SECONDS - start)) s"
  sed -n '/^| dtype/,$p' $out/adaptive_$run.log
done
