#!/bin/bash
# Session 30, sixth call: the op and backend tests after GatherRows learned 8-, 4- and 2-byte
# units (relu-llama-tiny's Q8_0 / Q4_0 rows, 408 and 216 bytes, are no multiple of 16: the split
# slots' loads failed on them in session30-split-slots). Bundle: gpu-worker/cuda/make_bundle.sh
# build /tmp/svcb/cudamod.
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
