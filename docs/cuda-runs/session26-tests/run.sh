#!/bin/bash
# Session 26: the op and backend tests of the submitted module (ColdFfn::Ahead and its test,
# AheadPrecedesEachDecodeLayersColdCallback). Bundle: cudamod of the work tree.
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
for t in cuda_ops_test cuda_backend_test; do
  PINFER_CUDA_MODULE=/tmp/s/cudamod/bin/libpinfer_cuda.so PINFER_MODELS_DIR="$PWD/models" timeout 250 $bin/$t > $out/$t.log 2>&1
  echo "== $t: rc $?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran" $out/$t.log
done
