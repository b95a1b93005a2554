#!/bin/bash
# Session 19: the whole service with 1, 2 and 4 decode lanes (--decode-lanes) on relu-llama-tiny,
# one process each, one after another: the 12 reference prompts one by one and all at once, then
# decode tokens/s for 1 stream and 4 concurrent streams (128 tokens, 3 repeats); then with
# --vram-budget 24MiB (the plan, lanes included, against what the worker allocates). Bundle made
# on the Debian machine:
#   bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod
#   tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
for lanes in 1 2 4 1 2 4; do
  d=/tmp/svc-lanes$lanes-$RANDOM
  THREADS=none TOKENS=128 REPEATS=3 STREAMS=4 GPU_FLAGS="--decode-lanes $lanes" OUT=$d bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $d.log 2>&1
  echo "== --decode-lanes $lanes: rc $?"
  grep -E "prompts match|check|lane steps|decode lanes:|concurrent streams|1 stream" $d.log
  cp $d.log $out/service-lanes$lanes-$(basename $d).log
done
d=/tmp/svc-budget
THREADS=none TOKENS=64 REPEATS=1 GPU_FLAGS="--vram-budget 24MiB" OUT=$d bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $d.log 2>&1
echo "== --vram-budget 24MiB: rc $?"
grep -E "prompts match|check|VRAM|decode lanes:" $d.log
cp $d.log $out/service-budget.log
