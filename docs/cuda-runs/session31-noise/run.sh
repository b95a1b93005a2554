#!/bin/bash
# Session 31, sixth call: a swap rule with a noise margin against the plain gain, measured and
# not kept (reverted uncommitted after this call; docs/benchmarks.md, run 48). The rule: a cold
# neuron counted a takes the slot of one counted b (counts in tokens, decay d) only when
# a > b + min_gain + z * sqrt((pa (1 - pa) + pb (1 - pb)) / (1 - d^2)), p = count * (1 - d): the
# standard deviation of the difference of two decayed counts of Bernoulli activations at the
# rates the counts suggest, so that neurons of equal rates stop displacing each other while a
# moderately hot one still takes an idle slot. With it the bench's defaults were min_gain 1 and
# z 2 ("margin"); "plain" is the submitted rule (gain 2, --cache-noise=0 then). Every hot row as
# cache, the bench's 256 swaps a plan, two rounds per process (medians), one process per dtype
# and rule. Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod, packed to
# .device/cudamod.tar.xz.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
# dtype, rule name, flags
while read -r d name flags; do
  LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 60 $bin/cuda_decode_bench \
    --dtype=$d --modes=adaptive --warmup=48 --steps=64 --cache-fractions=1.0 --rounds=2 \
    $flags < /dev/null > $out/adaptive_${d}_$name.log 2>&1
  echo "== adaptive $d $name ($flags): rc $? at $((SECONDS - start)) s"
  sed -n '/^Medians/,$p' $out/adaptive_${d}_$name.log | grep "^|" | cut -d'|' -f3-9,12-14
done <<'LIST'
Q4_0 plain --cache-gain=2 --cache-noise=0
Q4_0 margin
F16 plain --cache-gain=2 --cache-noise=0
F16 margin
LIST
