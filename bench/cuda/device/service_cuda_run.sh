#!/bin/bash
# The whole service (gateway, CUDA gpu-worker, cpu-worker) on a GPU machine. Exact mode:
# relu-llama-tiny's 12 reference prompts one by one and all at once (bench/device_service_run.sh).
# Sparse mode (bench/device_sparse_run.sh, relu-llama-tiny prepared in the call): the gpu-worker on
# the CPU, on CUDA, on CUDA with the adaptive hot set (--adaptive-cache-rows 128), and the same
# with its bookkeeping on a thread of its own (--adaptive-cache-thread); both adaptive runs'
# 128-token continuations must equal the CUDA run's without the cache. Run from the repository
# root on the device, with the bundles made here by
#
#   bench/make_service_bundle.sh BUILD_DIR /tmp/svcb/svc
#   gpu-worker/cuda/make_bundle.sh CUDA_BUILD_DIR /tmp/svcb/cudamod
#   # packed together to .device/svc-slim.tar.xz with only the module and libcudart of the
#   # latter (the carried files are limited to 64 MiB with the working tree)
#
#   bench/cuda/device/service_cuda_run.sh OUT
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc-slim.tar.xz -C /tmp/s
mkdir -p $out/exact
THREADS=none TOKENS=128 REPEATS=2 STREAMS=4 OUT=$out/exact timeout 150 \
  bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/exact.log 2>&1
echo "== service, exact mode: rc $? at $((SECONDS - start)) s"
grep -E "^reference|tokens/s|^\| service" $out/exact/bench_cuda_service.md
mkdir -p $out/sparse
PREPARE_FLAGS="--ranks 96 --max-tokens 16384" OUT=$out/sparse timeout 300 \
  bench/device_sparse_run.sh /tmp/s/svc /tmp/s/cudamod > $out/sparse.log 2>&1
echo "== service, sparse mode: rc $? at $((SECONDS - start)) s"
grep -E "^==|reference:|MISMATCH|adaptive|^pinfer_worker_neurons" $out/sparse.log | head -60
