#!/bin/bash
# Sparse mode (predictors) through the whole service on a GPU machine: prepares relu-llama-tiny
# there (profile, predictors, PWRI file), then serves it with `--sparse` twice, once with the
# gpu-worker on the CPU and once on the GPU (CUDA module), and compares: greedy tokens of both
# against each other and against the dense reference.json, and the FFN sparsity each reports.
# Run from the repository root with bundles from bench/make_service_bundle.sh and a folder whose
# bin/ holds libpinfer_cuda.so (PREPARE_FLAGS, e.g. "--ranks 96 --max-tokens 16384", shortens the
# preparation; CACHE_ROWS sets the adaptive runs' --adaptive-cache-rows, 128; RUNS picks runs of
# "cpu cuda cuda-adaptive cuda-adaptive-thread", all by default):
#
#   bench/device_sparse_run.sh SERVICE_BUNDLE CUDA_BUNDLE      # results in $OUT (./sparse-results)
#
# Prompt batches on the GPU take the union of their tokens' predicted neurons (the CPU backend
# uses each token's own), so the continuations may differ after the prompt: this is a report, not
# a test. Step-by-step equality of the GPU's predicted mode with the CPU's is what
# CudaBackendTest.PredictedModeMatchesCpuPredictedSparseFfn asserts.
set -uo pipefail
b=$(realpath "${1:?service bundle}")
cb=$(realpath "${2:?cuda bundle}")
out=${OUT:-./sparse-results}
mkdir -p "$out"
model=models/relu-llama-tiny
cublas=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
  if [[ -e $d/libcublas.so.13 ]]; then cublas=$d; break; fi
done
[[ -z $cublas ]] && cublas=$(dirname "$(find / -name 'libcublas.so.13' -not -path '/proc/*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$b/lib:$cb/lib:$cublas"
prepared=$(mktemp -d)/tiny-prepared.gguf
timeout 400 "$b/bin/pinfer" prepare --model $model --calibration $model/calibration.txt \
  --out "$prepared" --threads "${PREPARE_THREADS:-16}" ${PREPARE_FLAGS:-} > "$out/prepare.log" 2>&1 || {
  tail -20 "$out/prepare.log"; exit 1; }
tail -12 "$out/prepare.log"
rc=0
# cuda-adaptive: the CUDA backend with the adaptive hot set (--adaptive-cache-rows); it computes
# the same predicted-active neurons, only moving some from the cpu-worker to cache slots;
# cuda-adaptive-thread: the same with its bookkeeping on a thread of its own.
for run in ${RUNS:-cpu cuda cuda-adaptive cuda-adaptive-thread}; do
  backend=${run%%-*}
  extra=()
  [[ $run == cuda-adaptive* ]] && extra=(--adaptive-cache-rows "${CACHE_ROWS:-128}")
  [[ $run == cuda-adaptive-thread ]] && extra+=(--adaptive-cache-thread)
  dir=$(mktemp -d)
  seg=/pinfer-sparse-$run-$$
  PINFER_CUDA_MODULE="$cb/bin/libpinfer_cuda.so" "$b/bin/pinfer-gpu-worker" --model "$prepared" \
    --sparse --backend $backend "${extra[@]}" --segment $seg --listen 127.0.0.1:0 --port-file "$dir/gpu.port" \
    --metrics-port 127.0.0.1:0 --metrics-port-file "$dir/gpu.mport" > "$out/gpu-worker-$run.log" 2>&1 &
  gp=$!
  "$b/bin/pinfer-cpu-worker" --model "$prepared" --segment $seg --threads 4 \
    > "$out/cpu-worker-$run.log" 2>&1 &
  cp=$!
  for i in $(seq 600); do [[ -s $dir/gpu.port ]] && break; sleep 0.1; done
  "$b/bin/pinfer-gateway" --workers "127.0.0.1:$(cat "$dir/gpu.port")" --listen 127.0.0.1:0 \
    --port-file "$dir/gw.port" > "$out/gateway-$run.log" 2>&1 &
  gw=$!
  for i in $(seq 600); do [[ -s $dir/gw.port ]] && break; sleep 0.1; done
  echo "== gpu-worker $run, --sparse: against the dense reference.json"
  timeout 300 "$b/bin/service_bench" --address "127.0.0.1:$(cat "$dir/gw.port")" \
    --reference $model/reference.json --write-greedy "$out/greedy-$run.json" \
    --tokens 128 --repeats 2 --streams 1 2>&1 | tee "$out/bench-$run.md" | grep -v MISMATCH
  if [[ $run == cuda ]]; then
    echo "== gpu-worker on cuda against on cpu (both --sparse)"
    timeout 300 "$b/bin/service_bench" --address "127.0.0.1:$(cat "$dir/gw.port")" \
      --reference "$out/greedy-cpu.json" --tokens 8 --repeats 1 --streams 1 2>&1 |
      grep -E "reference:|MISMATCH" | tee "$out/cuda-vs-cpu.txt"
  fi
  if [[ $run == cuda-adaptive* ]]; then
    # The same neurons, computed once each: the 128-token continuations must equal cuda's.
    echo "== $run against cuda without the adaptive hot set (128 tokens)"
    timeout 300 "$b/bin/service_bench" --address "127.0.0.1:$(cat "$dir/gw.port")" \
      --reference "$out/greedy-cuda.json" --tokens 128 --repeats 1 --streams 1 2>&1 |
      grep -E "reference:|MISMATCH" | tee "$out/$run-vs-cuda.txt"
    grep -q "MISMATCH" "$out/$run-vs-cuda.txt" && rc=1
  fi
  curl -s "http://127.0.0.1:$(cat "$dir/gpu.mport")/metrics" > "$out/gpu-worker-$run.metrics"
  grep -E '^pinfer_worker_ffn_sparsity|^pinfer_worker_neurons_computed_total|^pinfer_worker_adaptive' \
    "$out/gpu-worker-$run.metrics"
  kill $gw $gp $cp 2>/dev/null
  wait $gw $gp $cp 2>/dev/null
  grep -E "placement|computing|CUDA|sparse|adaptive" "$out/gpu-worker-$run.log" | head -10
done
exit $rc
