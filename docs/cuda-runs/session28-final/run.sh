#!/bin/bash
# Session 28, third call: the submitted code (the guess's recall target now 0.9), and what ranking
# a guess could give. The op and backend tests; one F16 sequence at skew 20% with the bench's drawn
# guess (pinned prefetcht0 loads stopped at x) at relu-llama-tiny's sizes (0.9 at 1.9x, 0.95 at
# 2.2x), unranked and ranked perfectly (COLD_AHEAD_RANKED=1: each part loads its active neurons
# first), and a perfect guess; then the whole service in exact mode (12 reference prompts one by
# one and all at once) and relu-llama-tiny prepared here, served in sparse mode with --cold-guess
# / --prefetch-guess at the new default. Bundles: bench/make_service_bundle.sh build
# /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod.
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
r="+COLD_AHEAD_RANKED=1"
LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 200 $bin/cuda_decode_bench --dtype=F16 --modes=pinfer \
  --variant-modes=pinfer --rounds=3 --skews=0.2 --steps=48 --warmup=16 \
  --variants="base;COLD_AHEAD=1$p;COLD_AHEAD=0.9:1.9$p;COLD_AHEAD=0.9:1.9$p$r;COLD_AHEAD=0.95:2.2$p;COLD_AHEAD=0.95:2.2$p$r" \
  > $out/bench_F16.log 2>&1
echo "== bench F16: rc $? at $((SECONDS - start)) s"
grep -E "^cold rows|bandwidth after" $out/bench_F16.log | cut -c1-300
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
echo "== service, sparse, guess at the default recall: rc $? at $((SECONDS - start)) s"
grep -E "^reference|tokens/s|^\| service" $out/guess/bench_cuda_service.md
grep -E "^pinfer_worker_cold_guess_neurons_total" $out/guess/gpu-worker.metrics
grep -E "^pinfer_worker_guessed_neurons_loaded_total" $out/guess/cpu-worker.metrics
grep -iE "error|fail" $out/guess/gpu-worker.log $out/guess/cpu-worker.log | head -5
