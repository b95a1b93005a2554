#!/bin/bash
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
BENCH_DTYPES=" " gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/run.log 2>&1
grep -E "PASSED|FAILED" $out/run.log | head
