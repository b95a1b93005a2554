#!/bin/bash
# Where the 70B service's per-layer exchange goes on the GPU host (issue 43, part 2): the gpu-worker
# waited 0.27 ms per exchange in session 41 for 442 cold neurons that the bench's in-process
# callback computes in 0.05 ms. The suspects are three sleeps a layer, each a futex wake-up of
# tens of microseconds: the cpu-worker's exchange thread (polls --exchange-spin-us, 20), its
# compute pool (polls --spin-us, 200) and the gpu-worker's waiting thread (--exchange-spin-us).
# This runs, on the device, from the repository root with the service bundle unpacked as
# seventy_b_service_run.sh expects (.device/svc-slim.tar.xz):
#   1. thread_pool_bench at 14 threads (the pool's wake-up; thread_pool_bench_before, if the
#      bundle has it, is the same bench built before 3a4389d, the condition-variable pool);
#   2. exchange_bench (one handoff against both ends' polling, answered by one thread and by a
#      14-thread pool as the cpu-worker's);
#   3. the 70B service (seventy_b_service_run.sh) with the defaults, both ends polling 200 us,
#      1000 us with the pool polling 2000 us, and the GPU's cold guesses loaded ahead;
#   4. with COLD=1, a start with the model file out of the page cache.
#
#   bench/cuda/device/exchange_polling_run.sh OUT
#
# The "before" pool bench, built here and added to the bundle's bin/ before packing:
#   mkdir -p /tmp/old/shared/util && for f in thread_pool.h thread_pool.cc; do
#     git show 3e9c77b:shared/util/$f > /tmp/old/shared/util/$f; done
#   g++ -std=c++20 -O2 -I/tmp/old -I. bench/thread_pool_bench.cc /tmp/old/shared/util/thread_pool.cc \
#     -o /tmp/svcb/svc/bin/thread_pool_bench_before -labsl_strings -labsl_str_format_internal \
#     -labsl_throw_delegate -pthread
set -u
out=$(realpath -m "${1:?output dir}")
mkdir -p "$out" /tmp/s
[ -d /tmp/s/svc ] || tar -xJf .device/svc-slim.tar.xz -C /tmp/s
b=/tmp/s/svc
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
for bench in thread_pool_bench thread_pool_bench_before; do
  [ -x $b/bin/$bench ] || continue
  echo "== $bench"
  LD_LIBRARY_PATH=$b/lib $b/bin/$bench threads=14 gaps_us=0,100,400,1000 loops=3000 | tee "$out/$bench.txt"
done
echo "== exchange_bench"
# One thread answering, then the cpu-worker's 14-thread pool polling 200 us (its default) and 2 ms.
for pool in "threads=1" "threads=14 pool_spin_us=200" "threads=14 pool_spin_us=2000"; do
  LD_LIBRARY_PATH=$b/lib $b/bin/exchange_bench steps=50 gap_us=250 compute_us=60 $pool |
    tee -a "$out/exchange_bench.txt"
done
one() {  # name time-limit env...
  local name=$1 lim=$2
  shift 2
  timeout "$lim" env REPEATS=3 "$@" bench/cuda/device/seventy_b_service_run.sh "$out/$name" > "$out/$name.log" 2>&1
  echo "== $name rc=$?"
  pkill -9 -f "pinfer-(gpu|cpu)-worker|pinfer-gateway"
  sleep 1
  grep -E "^first token|^repeat|^peak|^GPU memory|^cpu-worker threads|shm_wait|compute_seconds_(sum|count)|page cache" "$out/$name/summary.txt"
}
g="--gpu-slots 2 --max-context 4096"
one default 200   # the first run writes the 40 GB file (84 s on the H100)
one poll200 100 CPU_FLAGS="--exchange-spin-us 200" GPU_FLAGS="$g --exchange-spin-us 200"
one poll1000 100 CPU_FLAGS="--exchange-spin-us 1000 --spin-us 2000" GPU_FLAGS="$g --exchange-spin-us 1000"
one guess 100 CPU_FLAGS="--prefetch-guess" GPU_FLAGS="$g --cold-guess"
[ "${COLD:-0}" = 1 ] && one coldcache 170 DROP_CACHES=1
exit 0
