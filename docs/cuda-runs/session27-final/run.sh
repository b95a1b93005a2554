#!/bin/bash
# Session 27, last call: main as submitted (the module's cold guess made beside the previous
# layer's hot rows by default; the gpu-worker's --cold-guess). The op and backend tests; the whole
# service in exact mode (relu-llama-tiny's 12 reference prompts one by one and all at once, 4
# streams); then the service in sparse mode with the guess on, on a relu-llama-tiny prepared in
# this call (pinfer prepare, rank-128 predictors): how much of each layer's actual cold list the
# module's guesses held, and how large they were (pinfer_worker_cold_guess_neurons_total). Sparse
# mode's tokens are the predictors', not transformers', so its reference check is not expected to
# pass. Bundles: bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh
# build /tmp/svcb/cudamod.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
for t in cuda_ops_test cuda_backend_test; do
  PINFER_CUDA_MODULE=$bin/libpinfer_cuda.so PINFER_MODELS_DIR="$PWD/models" timeout 200 $bin/$t > $out/$t.log 2>&1
  echo "== $t: rc $? at $((SECONDS - start)) s"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran|^guess:" $out/$t.log
  grep -B3 -A12 "Failure" $out/$t.log | head -40
done
mkdir -p $out/exact $out/guess
THREADS=none TOKENS=128 REPEATS=2 STREAMS=4 OUT=$out/exact timeout 150 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/exact.log 2>&1
echo "== service, exact: rc $? at $((SECONDS - start)) s"
grep -E "reference|tokens/s|^\| service" $out/exact.log | tail -8
LD_LIBRARY_PATH=/tmp/s/svc/lib timeout 240 /tmp/s/svc/bin/pinfer prepare --model models/relu-llama-tiny \
  --calibration models/relu-llama-tiny/calibration.txt --out /tmp/s/tiny-prepared.gguf --ranks 128 \
  --threads 16 > $out/prepare.log 2>&1
echo "== prepare: rc $? at $((SECONDS - start)) s"
MODEL=/tmp/s/tiny-prepared.gguf GPU_FLAGS="--sparse --cold-guess" THREADS=none TOKENS=128 REPEATS=1 STREAMS=4 \
  OUT=$out/guess timeout 150 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/guess.log 2>&1
echo "== service, sparse with the guess: rc $? at $((SECONDS - start)) s"
grep -E "reference|tokens/s|^\| service" $out/guess.log | tail -8
grep -E "^pinfer_worker_cold_guess_neurons_total|^pinfer_worker_neurons_computed_total" $out/guess/gpu-worker.metrics
