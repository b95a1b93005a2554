#!/bin/bash
# Session 30, eighth call: GatherRows as one small grid-stride grid (16 blocks by default;
# PINFER_CUDA_GATHER_BLOCKS=N) instead of a block per row piece, which held every multiprocessor
# while its zero-copy reads waited on PCIe (session30-overlap: the step's attention 20-50%
# slower). The backend test; the overlapped staging bench for F16 with 16, 64 and a full grid
# (100000: one block per 256 units, about the old shape), one process each; the adaptive hot set
# on Q4_0 as in session30-split-slots. Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod.
# The 16-block gather (GatherRowsKernel as one grid-stride loop over every row's units, grid
# min(PINFER_CUDA_GATHER_BLOCKS or 16, units / 256)) was measured uncommitted and reverted after
# session30-adaptive: docs/benchmarks.md, run 47.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
LD_LIBRARY_PATH=/tmp/s/cudamod/lib PINFER_CUDA_MODULE=$bin/libpinfer_cuda.so \
  PINFER_MODELS_DIR="$PWD/models" timeout 120 $bin/cuda_backend_test > $out/cuda_backend_test.log 2>&1
echo "== cuda_backend_test: rc $? at $((SECONDS - start)) s"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran" $out/cuda_backend_test.log
grep -B3 -A12 "Failure" $out/cuda_backend_test.log | head -30
for b in 16 64 100000; do
  PINFER_CUDA_GATHER_BLOCKS=$b PINFER_CUDA_COLD_AHEAD_PIN=1 PINFER_CUDA_COLD_AHEAD_HINT=3 \
    LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 120 $bin/cuda_decode_bench --dtype=F16 \
    --modes=staged --stage-rows=0,100,200 --stage-ahead=1 --stage-overlap=1 --rounds=2 \
    --skews=0.2 --steps=48 --warmup=16 > $out/staged_F16_$b.log 2>&1
  echo "== staged, overlapped F16, gather blocks $b: rc $? at $((SECONDS - start)) s"
  grep -E "^round 1" $out/staged_F16_$b.log | cut -c1-250
  sed -n '/^| dtype/,$p' $out/staged_F16_$b.log
done
LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 120 $bin/cuda_decode_bench --dtype=Q4_0 --modes=adaptive \
  --warmup=48 --steps=64 --cache-fractions=0.5,1.0 > $out/adaptive_Q4_0.log 2>&1
echo "== adaptive Q4_0: rc $? at $((SECONDS - start)) s"
sed -n '/^| dtype/,$p' $out/adaptive_Q4_0.log
