#!/bin/bash
# Session 30, fifth call: Q8_0 / Q4_0 matrices with adaptive cache slots now keep the split layout
# (slots gathered in GGUF's layout and rewritten into it), where before they kept GGUF's layout
# and its slower kernels for every hot row. The op and backend tests (AdaptiveCacheRowsMatch-
# CpuReference now also on Q8_0 and Q4_0 copies); the staging bound of session30-staged-ahead
# again for Q4_0 (its GPU hot FFN rose from 1.52 to 2.25-2.32 ms a token with slots there); the
# adaptive hot set's bench on Q4_0. Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for t in cuda_ops_test cuda_backend_test; do
  LD_LIBRARY_PATH=/tmp/s/cudamod/lib PINFER_CUDA_MODULE=$bin/libpinfer_cuda.so \
    PINFER_MODELS_DIR="$PWD/models" timeout 250 $bin/$t > $out/$t.log 2>&1
  echo "== $t: rc $? at $((SECONDS - start)) s"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran" $out/$t.log
  grep -B3 -A12 "Failure" $out/$t.log | head -40
done
grep -A3 "AdaptiveCacheRowsMatchCpuReference" $out/cuda_backend_test.log | head -8
PINFER_CUDA_COLD_AHEAD_PIN=1 PINFER_CUDA_COLD_AHEAD_HINT=3 LD_LIBRARY_PATH=/tmp/s/cudamod/lib \
  timeout 150 $bin/cuda_decode_bench --dtype=Q4_0 --modes=staged --stage-rows=0,100,200 \
  --stage-ahead=1 --rounds=3 --skews=0.2 --steps=48 --warmup=16 > $out/staged_Q4_0.log 2>&1
echo "== staged Q4_0: rc $? at $((SECONDS - start)) s"
grep -E "^staged|^round 1" $out/staged_Q4_0.log | cut -c1-250
sed -n '/^| dtype/,$p' $out/staged_Q4_0.log
LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 200 $bin/cuda_decode_bench --dtype=Q4_0 --modes=adaptive \
  --warmup=48 --steps=64 --cache-fractions=0.5,1.0 > $out/adaptive_Q4_0.log 2>&1
echo "== adaptive Q4_0: rc $? at $((SECONDS - start)) s"
grep -E "^adaptive|^cache fraction|tokens/s" $out/adaptive_Q4_0.log | cut -c1-250
sed -n '/^| dtype/,$p' $out/adaptive_Q4_0.log
