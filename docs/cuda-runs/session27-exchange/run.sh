#!/bin/bash
# Session 27: the guess through the whole service. relu-llama-tiny prepared in this call (rank-128
# predictors on 30,000 calibration tokens), served in sparse mode twice: without the guess, then
# with the gpu-worker's --cold-guess and the cpu-worker's --prefetch-guess (the guess posted
# through the segment before each layer's request, the guessed rows loaded by the pinned threads
# until the request comes). The guess is a hint, so both runs must give the same tokens (the same
# reference count in sparse mode, where the predictors choose the neurons); the cpu-worker's
# pinfer_worker_guessed_neurons_loaded_total shows the loads ran. Bundles:
# bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build
# /tmp/svcb/cudamod.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
LD_LIBRARY_PATH=/tmp/s/svc/lib timeout 150 /tmp/s/svc/bin/pinfer prepare --model models/relu-llama-tiny \
  --calibration models/relu-llama-tiny/calibration.txt --out /tmp/s/tiny-prepared.gguf --ranks 128 \
  --max-tokens 30000 --threads 16 > $out/prepare.log 2>&1
echo "== prepare: rc $? at $((SECONDS - start)) s"
mkdir -p $out/plain $out/guess
MODEL=/tmp/s/tiny-prepared.gguf GPU_FLAGS="--sparse" THREADS=none TOKENS=64 REPEATS=1 STREAMS=4 \
  OUT=$out/plain timeout 100 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/plain.log 2>&1
echo "== sparse: rc $? at $((SECONDS - start)) s"
grep -E "^reference|tokens/s|^\| service" $out/plain/bench_cuda_service.md
MODEL=/tmp/s/tiny-prepared.gguf GPU_FLAGS="--sparse --cold-guess" CPU_FLAGS="--prefetch-guess" THREADS=none \
  TOKENS=64 REPEATS=1 STREAMS=4 OUT=$out/guess timeout 100 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/guess.log 2>&1
echo "== sparse, guess posted and loaded: rc $? at $((SECONDS - start)) s"
grep -E "^reference|tokens/s|^\| service" $out/guess/bench_cuda_service.md
grep -E "^pinfer_worker_cold_guess_neurons_total" $out/guess/gpu-worker.metrics
grep -E "^pinfer_worker_guessed_neurons_loaded_total|^pinfer_worker_neurons_computed_total" $out/guess/cpu-worker.metrics
grep -iE "error|fail" $out/guess/gpu-worker.log $out/guess/cpu-worker.log | head -5
