#!/bin/bash
# Session 31, second call: the adaptive bench again after session31-adaptive, with the bench's
# kGiven split ordering a layer's slots by marking instead of sorting, and tokens/s also given
# less the split's time (the service's GPU makes that split). F16 and Q4_0 with every core in the
# cold pool, F16 with 15 (a core left for the counting thread), one process each.
# Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod, packed to .device/cudamod.tar.xz.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
for run in F16_16 Q4_0_16 F16_15 F16_16b; do
  d=${run%_*}
  t=${run##*_}
  t=${t%b}
  LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 150 $bin/cuda_decode_bench \
    --dtype=$d --modes=adaptive --warmup=48 --steps=64 --cache-fractions=0.5,1.0 --threads=$t \
    > $out/adaptive_$run.log 2>&1
  echo "== adaptive $run: rc $? at $((SECONDS - start)) s"
  sed -n '/^| dtype/,$p' $out/adaptive_$run.log
done
