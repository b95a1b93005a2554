#!/bin/bash
# The service benchmark on a quiet machine (a GPU host): the CPU service against the in-process
# engine at 1 and 4 threads per process, then, with a CUDA bundle, the service with the gpu-worker
# on the GPU (greedy tokens against reference.json, then decode speed). Run from the repository
# root with bundles from bench/make_service_bundle.sh and gpu-worker/cuda/make_bundle.sh:
#
#   bench/device_service_run.sh SERVICE_BUNDLE [CUDA_BUNDLE]      # results in $OUT (./service-results)
#
# GPU_FLAGS are appended to the gpu-worker's command line (e.g. "--vram-budget 24MiB"); when the
# worker plans under a VRAM budget, the run fails unless its allocation is within 5% of the plan.
# CPU_FLAGS are appended to the cpu-worker's (e.g. "--spin-us 0"); CPU_THREADS is its --threads
# (default 4). MODEL: the file or folder the workers serve (default models/relu-llama-tiny, e.g. a
# prepared relu-llama-tiny for --sparse); the reference is relu-llama-tiny's either way.
set -uo pipefail
b=$(realpath "${1:?service bundle}")
cb=${2:+$(realpath "$2")}
out=${OUT:-./service-results}
mkdir -p "$out"
model=models/relu-llama-tiny
served=${MODEL:-$model}
nproc; grep -m1 'model name' /proc/cpuinfo
rc=0
for t in ${THREADS:-1 4}; do
  [[ $t == none ]] && continue
  LD_LIBRARY_PATH="$b/lib" timeout 300 "$b/bin/service_bench" --pinfer "$b/bin/pinfer" \
    --model $model --tokens "${TOKENS:-256}" --threads "$t" --repeats "${REPEATS:-3}" \
    --streams "${STREAMS:-4}" \
    2>&1 | tee "$out/bench_cpu_t$t.md" || rc=1
done
if [[ -n $cb ]]; then
  ls -la "$cb" "$cb/bin"
  cublas=""
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    if [[ -e $d/libcublas.so.13 ]]; then cublas=$d; break; fi
  done
  [[ -z $cublas ]] && cublas=$(dirname "$(find / -name 'libcublas.so.13' -not -path '/proc/*' 2>/dev/null | head -1)")
  export LD_LIBRARY_PATH="$b/lib:$cb/lib:$cublas"
  dir=$(mktemp -d)
  seg=/pinfer-device-$$
  PINFER_CUDA_MODULE="$cb/bin/libpinfer_cuda.so" "$b/bin/pinfer-gpu-worker" --model $served \
    --segment $seg --listen 127.0.0.1:0 --port-file "$dir/gpu.port" --backend cuda \
    --metrics-port 127.0.0.1:0 --metrics-port-file "$dir/gpu.mport" ${GPU_FLAGS:-} \
    > "$out/gpu-worker.log" 2>&1 &
  gp=$!
  "$b/bin/pinfer-cpu-worker" --model $served --segment $seg --threads "${CPU_THREADS:-4}" \
    --metrics-port 127.0.0.1:0 --metrics-port-file "$dir/cpu.mport" \
    ${CPU_FLAGS:-} > "$out/cpu-worker.log" 2>&1 &
  cp=$!
  for i in $(seq 600); do [[ -s $dir/gpu.port ]] && break; sleep 0.1; done
  "$b/bin/pinfer-gateway" --workers "127.0.0.1:$(cat "$dir/gpu.port")" --listen 127.0.0.1:0 \
    --port-file "$dir/gw.port" > "$out/gateway.log" 2>&1 &
  gw=$!
  for i in $(seq 600); do [[ -s $dir/gw.port ]] && break; sleep 0.1; done
  timeout 300 "$b/bin/service_bench" --address "127.0.0.1:$(cat "$dir/gw.port")" \
    --reference $model/reference.json --tokens "${TOKENS:-256}" --repeats "${REPEATS:-3}" \
    --streams "${STREAMS:-4}" \
    2>&1 | tee "$out/bench_cuda_service.md" || rc=1
  if grep -Eq 'reference: ([0-9]+)/\1 prompts match' "$out/bench_cuda_service.md"; then
    echo "reference check: every prompt's greedy tokens match"
  else
    echo "reference check FAILED: $(grep -E 'reference:' "$out/bench_cuda_service.md")"; rc=1
  fi
  # The same prompts all at once (decode batches, and the CUDA backend's lanes).
  if grep -Eq 'reference, all prompts at once: ([0-9]+)/\1 prompts match' "$out/bench_cuda_service.md"; then
    echo "concurrent reference check: every prompt's greedy tokens match"
  else
    echo "concurrent reference check FAILED: $(grep -E 'reference, all' "$out/bench_cuda_service.md")"; rc=1
  fi
  curl -s "http://127.0.0.1:$(cat "$dir/gpu.mport")/metrics" > "$out/gpu-worker.metrics" 2>/dev/null || true
  curl -s "http://127.0.0.1:$(cat "$dir/cpu.mport")/metrics" > "$out/cpu-worker.metrics" 2>/dev/null || true
  kill $gw $gp $cp 2>/dev/null
  # A worker that does not stop (a hang) must not hold the run: 40 s (past the drain timeout),
  # then SIGKILL, and the run fails.
  for i in $(seq 400); do kill -0 $gw $gp $cp 2>/dev/null || break; sleep 0.1; done
  if kill -0 $gw $gp $cp 2>/dev/null; then
    echo "a process did not stop on SIGTERM: killed"; kill -9 $gw $gp $cp 2>/dev/null; rc=1
  fi
  wait $gw $gp $cp 2>/dev/null
  cat "$out/gpu-worker.log"
  # Prompt layers by who computed their cold rows (--cold-prefill); with "stream" forced, some
  # prompt (relu-llama-tiny's prompts 5 and 10 have more than 8 tokens) must have streamed.
  streamed=$(awk '/^pinfer_worker_prefill_cold_layers_total\{path="stream"\}/ {print $2}' "$out/gpu-worker.metrics")
  on_cpu=$(awk '/^pinfer_worker_prefill_cold_layers_total\{path="cpu"\}/ {print $2}' "$out/gpu-worker.metrics")
  sbytes=$(awk '/^pinfer_worker_streamed_cold_bytes_total/ {print $2}' "$out/gpu-worker.metrics")
  echo "cold prefill: ${streamed:-?} prompt layers streamed (${sbytes:-?} bytes), ${on_cpu:-?} on the cpu-worker"
  if [[ " ${GPU_FLAGS:-} " == *" --cold-prefill stream "* ]]; then
    if awk -v s="${streamed:-0}" 'BEGIN { exit !(s > 0) }'; then
      echo "cold prefill check: layers were streamed"
    else
      echo "cold prefill check FAILED: --cold-prefill stream but no layer streamed"; rc=1
    fi
  fi
  # Decode lanes (--decode-lanes, 2 by default): the concurrent prompts and streams above must
  # have put steps on a second lane.
  lane_steps=$(awk '/^pinfer_worker_decode_lane_steps_total/ {print $2}' "$out/gpu-worker.metrics")
  echo "decode lanes: ${lane_steps:-?} steps on a second or later lane"
  if grep -q 'decode lanes: [2-9]' "$out/gpu-worker.log"; then
    if awk -v s="${lane_steps:-0}" 'BEGIN { exit !(s > 0) }'; then
      echo "decode lanes check: concurrent sequences ran on several lanes"
    else
      echo "decode lanes check FAILED: lanes were created but no step ran on one"; rc=1
    fi
  fi
  if grep -q 'VRAM: planned' "$out/gpu-worker.log"; then
    pct=$(sed -n 's/.*VRAM: planned .*(\([-+][0-9.]*\)%).*/\1/p' "$out/gpu-worker.log")
    if awk -v p="$pct" 'BEGIN { exit !(p <= 5 && p >= -5) }'; then
      echo "VRAM check: allocation within ${pct}% of the plan (limit 5%)"
    else
      echo "VRAM check FAILED: allocation ${pct}% off the plan"; rc=1
    fi
  fi
fi
exit $rc
