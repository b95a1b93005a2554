#!/bin/bash
# Session 31, fourth call: the swap gain (hysteresis) 2 (the default) against 6 with the
# gpu-worker's own cache settings (at most 64 swaps per layer every 4 tokens, decay 0.95; the
# bench's default is 256 swaps), after session31-churn found gain 6 better for Q4_0 with 256.
# Every hot row as cache, 192 warm-up tokens (64 swaps a plan fill 2752 slots in about 172), two
# rounds per process (medians). Bundle:
# gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod, packed to .device/cudamod.tar.xz.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
# dtype, swap gain
while read -r d g; do
  run=${d}_gain$g
  LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 150 $bin/cuda_decode_bench \
    --dtype=$d --modes=adaptive --warmup=192 --steps=64 --cache-fractions=1.0 --rounds=2 \
    --cache-swaps=64 --cache-gain=$g < /dev/null > $out/adaptive_$run.log 2>&1
  echo "== adaptive $run: rc $? at $((SECONDS - start)) s"
  sed -n '/^Medians/,$p' $out/adaptive_$run.log | grep -v "^$" | grep -v background
done <<'LIST'
F16 2
F16 6
Q4_0 2
Q4_0 6
LIST
