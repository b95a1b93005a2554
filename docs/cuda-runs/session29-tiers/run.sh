#!/bin/bash
# Session 29, first call: what the guess's first tier is worth on the 13B shape, with tiers drawn
# to match relu-llama-tiny's (lookahead_study's last table, layers 2-5: the tier holds 78-87% of
# the guessed neurons that are active and 23-39% of the others, so COLD_AHEAD_TIER=0.82:0.31),
# against the same guesses loaded in ascending order and ranked perfectly; one F16 sequence at
# skew 20%, guesses of 1.6x (layers 2-5's size) and 2.2x (the service's overall size). Before
# that the op and backend tests; after it the whole service in exact mode (12 reference prompts
# one by one and all at once) and relu-llama-tiny prepared here and served in sparse mode with
# --cold-guess / --prefetch-guess (the cpu-worker's new kind="first" series). Bundles:
# bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build
# /tmp/svcb/cudamod.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
for t in cuda_ops_test cuda_backend_test; do
  LD_LIBRARY_PATH=/tmp/s/cudamod/lib PINFER_CUDA_MODULE=$bin/libpinfer_cuda.so \
    PINFER_MODELS_DIR="$PWD/models" timeout 250 $bin/$t > $out/$t.log 2>&1
  echo "== $t: rc $? at $((SECONDS - start)) s"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran|^guess:" $out/$t.log
  grep -B3 -A12 "Failure" $out/$t.log | head -40
done
p="+COLD_AHEAD_PIN=1+COLD_AHEAD_HINT=3"
t="+COLD_AHEAD_TIER=0.82:0.31"
r="+COLD_AHEAD_RANKED=1"
LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 240 $bin/cuda_decode_bench --dtype=F16 --modes=pinfer \
  --variant-modes=pinfer --rounds=4 --skews=0.2 --steps=48 --warmup=16 \
  --variants="base;COLD_AHEAD=0.95:1.6$p;COLD_AHEAD=0.95:1.6$p$t;COLD_AHEAD=0.95:1.6$p$r;COLD_AHEAD=0.95:2.2$p;COLD_AHEAD=0.95:2.2$p$t" \
  > $out/bench_F16.log 2>&1
echo "== bench F16: rc $? at $((SECONDS - start)) s"
grep -E "^cold rows|bandwidth after" $out/bench_F16.log | cut -c1-330
sed -n '/^Over the rounds/,$p' $out/bench_F16.log
mkdir -p $out/exact
THREADS=none TOKENS=128 REPEATS=2 STREAMS=4 OUT=$out/exact timeout 150 \
  bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/exact.log 2>&1
echo "== service, exact mode: rc $? at $((SECONDS - start)) s"
grep -E "^reference|tokens/s|^\| service" $out/exact/bench_cuda_service.md
LD_LIBRARY_PATH=/tmp/s/svc/lib timeout 150 /tmp/s/svc/bin/pinfer prepare --model models/relu-llama-tiny \
  --calibration models/relu-llama-tiny/calibration.txt --out /tmp/s/tiny-prepared.gguf --ranks 128 \
  --max-tokens 30000 --threads 16 > $out/prepare.log 2>&1
echo "== prepare: rc $? at $((SECONDS - start)) s"
mkdir -p $out/guess
MODEL=/tmp/s/tiny-prepared.gguf GPU_FLAGS="--sparse --cold-guess" CPU_FLAGS="--prefetch-guess" \
  THREADS=none TOKENS=64 REPEATS=1 STREAMS=4 OUT=$out/guess \
  timeout 100 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/guess.log 2>&1
echo "== service, sparse, guess (sparse mode's greedy tokens may differ): rc $? at $((SECONDS - start)) s"
grep -E "^reference|tokens/s|^\| service" $out/guess/bench_cuda_service.md
grep -E "^pinfer_worker_cold_guess_neurons_total" $out/guess/gpu-worker.metrics
grep -E "^pinfer_worker_guessed_neurons_loaded_total" $out/guess/cpu-worker.metrics
grep -iE "error|fail" $out/guess/gpu-worker.log $out/guess/cpu-worker.log | head -5
