#!/bin/bash
# Session 23, after the final review: the op and module tests on the commit that moved
# kMaxColdParts into backend.h and simplified the cold signal (no behaviour change intended).
# Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod; tar | xz -9e .device/svc.tar.xz
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
BENCH_DTYPES=" " gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/tests.log 2>&1
echo "== tests: rc $?"
grep -E "^\[  (PASSED|FAILED) " $out/tests.log
