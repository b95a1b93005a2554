#!/bin/bash
# Session 28: a layer's guess withheld while it stays much larger than its list
# (cuda::ModelUpload::cold_guess_max_ratio, default 2). The op and backend tests; then what a
# guess of each size is worth to one F16 sequence at skew 20% (the bench's drawn guess, pinned
# prefetcht0 loads stopped at x: recall 0.95 at 1.2x, 1.6x, 2x and 3x the active cold rows, and
# recall 0.9 at 1.3x); then relu-llama-tiny prepared here and served in sparse mode with
# --cold-guess / --prefetch-guess three ways: the default, no withholding
# (PINFER_CUDA_COLD_GUESS_MAX_RATIO=0, session 27's behaviour) and a recall target of 0.9
# (PINFER_CUDA_COLD_GUESS_RECALL=0.9). Bundles: bench/make_service_bundle.sh build /tmp/svcb/svc;
# gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod.
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
LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 150 $bin/cuda_decode_bench --dtype=F16 --modes=pinfer \
  --variant-modes=pinfer --rounds=3 --skews=0.2 --steps=48 --warmup=16 \
  --variants="base;COLD_AHEAD=0.95:1.2$p;COLD_AHEAD=0.95:1.6$p;COLD_AHEAD=0.95:2$p;COLD_AHEAD=0.95:3$p;COLD_AHEAD=0.9:1.3$p" \
  > $out/bench_F16.log 2>&1
echo "== bench F16: rc $? at $((SECONDS - start)) s"
grep -E "^cold rows|bandwidth after" $out/bench_F16.log | cut -c1-300
sed -n '/^Over the rounds/,$p' $out/bench_F16.log
LD_LIBRARY_PATH=/tmp/s/svc/lib timeout 150 /tmp/s/svc/bin/pinfer prepare --model models/relu-llama-tiny \
  --calibration models/relu-llama-tiny/calibration.txt --out /tmp/s/tiny-prepared.gguf --ranks 128 \
  --max-tokens 30000 --threads 16 > $out/prepare.log 2>&1
echo "== prepare: rc $? at $((SECONDS - start)) s"
for run in default:2 nowithhold:0 recall90:2; do
  name=${run%%:*}
  mkdir -p $out/$name
  recall=0.95; [ $name = recall90 ] && recall=0.9
  PINFER_CUDA_COLD_GUESS_MAX_RATIO=${run#*:} PINFER_CUDA_COLD_GUESS_RECALL=$recall \
    MODEL=/tmp/s/tiny-prepared.gguf GPU_FLAGS="--sparse --cold-guess" CPU_FLAGS="--prefetch-guess" \
    THREADS=none TOKENS=64 REPEATS=1 STREAMS=4 OUT=$out/$name \
    timeout 100 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/$name.log 2>&1
  echo "== service $name (max ratio ${run#*:}, recall $recall): rc $? at $((SECONDS - start)) s"
  grep -E "^reference|tokens/s|^\| service" $out/$name/bench_cuda_service.md
  grep -E "^pinfer_worker_cold_guess_neurons_total" $out/$name/gpu-worker.metrics
  grep -E "^pinfer_worker_guessed_neurons_loaded_total" $out/$name/cpu-worker.metrics
  grep -iE "error|fail" $out/$name/gpu-worker.log $out/$name/cpu-worker.log | head -5
done
