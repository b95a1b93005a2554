#!/bin/bash
# Written in session 15, not yet run (the H200 time ran out): apply early-blocks.patch to main,
# copy this to .device/eb15.sh and run it with carry [".device/sdk", ".device/eb15.sh"]. A norm
# product's blocks from index N on (those
# that become resident late) load x before their first rows (QX_EARLY_BLOCKS=N), against all
# blocks loading their first rows before the wait (base). No tests: a measurement only.
set -u
out=$1
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=100 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=24 --warmup=6 --bandwidths=0 --variants=base;QX_EARLY_BLOCKS=200;QX_EARLY_BLOCKS=132;base;QX_EARLY_BLOCKS=200;QX_EARLY_BLOCKS=132" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/bench_*.log; do grep -E "^\| " $f | grep -v "^| dtype\|^|---" | cut -c1-110; done
