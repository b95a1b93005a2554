#!/bin/bash
# Session 18: the greedy pick on the GPU (LogitsMode::kGreedy, GreedyPick in kernels.cu): the
# bundle's op and backend tests, the whole model's decode with the pick on the GPU (base) against
# the logits copied to the host and picked there (PICK=host, the path before), alternating in one
# process for Q4_0 and F16, and the whole service (whose greedy requests now take the GPU's pick)
# on relu-llama-tiny's 12 reference prompts. Bundle made on the Debian machine:
#   bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod
#   tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
V="base;PICK=host"
BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0 F16" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=64 --warmup=16 --variants=$V;$V;$V" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/run.log 2>&1
grep -E "PASSED|FAILED|tests ran" $out/run.log | head
grep -E "Failure|Expected|Which is" $out/cuda_ops_test.log $out/cuda_backend_test.log | head -8
for f in $out/bench_*.log; do grep -E "^bandwidth|^gpu \[|^\| |whole model" $f | grep -v "^| dtype\|^|---" | cut -c1-160; done
THREADS=none TOKENS=64 REPEATS=1 GPU_FLAGS="" OUT=$out/service bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/service.log 2>&1
echo "service rc $?"; grep -E "prompts match|reference check" $out/service.log
