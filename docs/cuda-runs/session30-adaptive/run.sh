#!/bin/bash
# Session 30, tenth call: the adaptive hot set's bench with the new 16-block gather against a full
# grid (PINFER_CUDA_GATHER_BLOCKS=100000, about the old shape), one process each, Q4_0 then F16,
# as in the "Adaptive hot set" section. Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod.
# The 16-block gather (GatherRowsKernel as one grid-stride loop over every row's units, grid
# min(PINFER_CUDA_GATHER_BLOCKS or 16, units / 256)) was measured uncommitted and reverted after
# session30-adaptive: docs/benchmarks.md, run 47.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
for d in Q4_0 F16; do
  for b in 16 100000; do
    PINFER_CUDA_GATHER_BLOCKS=$b LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 70 $bin/cuda_decode_bench \
      --dtype=$d --modes=adaptive --warmup=48 --steps=64 --cache-fractions=0.5,1.0 \
      > $out/adaptive_${d}_$b.log 2>&1
    echo "== adaptive $d, gather blocks $b: rc $? at $((SECONDS - start)) s"
    sed -n '/^| dtype/,$p' $out/adaptive_${d}_$b.log
  done
done
