#!/bin/bash
# Issue 43's start-up figures through the product on ReluLLaMA-70B's shape: a prepared (PWRI)
# file with synthetic weights written on the GPU machine (bench/sparse/synthetic_pwri: skew 20%,
# 10% of neurons active), then the whole service on it as a user starts it (gpu-worker --sparse
# --backend cuda --vram-budget 24GiB, cpu-worker, gateway with the HTTP API), timed from the
# workers' start to the first streamed token of a 64-token greedy completion. Reported: that time
# and where it went (the workers' log lines carry times), decode tokens/s as the client sees
# them, peak resident memory of each worker (VmHWM) and the GPU memory used against the
# gpu-worker's VRAM plan, sampled every half second. Run from the repository root on the device:
#
#   bench/make_service_bundle.sh BUILD_DIR /tmp/svcb/svc
#   gpu-worker/cuda/make_bundle.sh BUILD_DIR /tmp/svcb/cudafull   # then cudamod/{bin,lib} gets
#   #   only libpinfer_cuda.so and libcudart; (cd /tmp/svcb && tar -cf - svc cudamod | xz -3) >
#   #   .device/svc-slim.tar.xz
#   bench/cuda/device/seventy_b_service_run.sh OUT
#
# Two sequences of 4096 positions (GPU_FLAGS; the default slots' KV cache alone would pass 24 GB).
# DTYPE (q4_0, q4_k, q8_0), SHAPE (synthetic_pwri's shape flags), BACKEND (cuda) and
# DROP_CACHES=1 (start with the file out of the page cache, as after a reboot), CPU_THREADS (14),
# VRAM_BUDGET (24GiB), CPU_FLAGS (more cpu-worker flags) and REPEATS (3 steady-state completions) change the run.
set -u
out=$(realpath -m "${1:?output dir}")
mkdir -p "$out" /tmp/s
[ -d /tmp/s/svc ] || tar -xJf .device/svc-slim.tar.xz -C /tmp/s
b=/tmp/s/svc
cb=/tmp/s/cudamod
export LD_LIBRARY_PATH=$b/lib:$cb/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
dtype=${DTYPE:-q4_0}
shape=${SHAPE:---layers 80 --hidden 8192 --ffn 28672 --heads 64 --kv-heads 8}
model=${MODEL_DIR:-/tmp}/synthetic-$dtype.gguf
if [ ! -s "$model" ]; then
  $b/bin/synthetic_pwri --out "$model" --vocab-gguf models/llama2-vocab/llama-2-tiny-random.gguf \
    --dtype "$dtype" --rank 256 $shape 2>&1 | tee "$out/synthetic.log" || exit 1
fi
ls -la "$model"
free -m > "$out/free-before.txt"
if [ "${DROP_CACHES:-0}" = 1 ]; then
  sync && echo 3 > /proc/sys/vm/drop_caches && echo "page cache dropped"
fi
dir=$(mktemp -d)
seg=/pinfer-70b-$$
now() { date +%s.%N; }
minus() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a - b }'; }
t0=$(now)
$b/bin/pinfer-gpu-worker --model "$model" --sparse --backend "${BACKEND:-cuda}" \
  --cuda-module "$cb/bin/libpinfer_cuda.so" --vram-budget "${VRAM_BUDGET:-24GiB}" --threads 2 --segment $seg \
  ${GPU_FLAGS:---gpu-slots 2 --max-context 4096} \
  --listen 127.0.0.1:0 --port-file "$dir/gpu.port" --metrics-port 127.0.0.1:0 \
  --metrics-port-file "$dir/gpu.mport" > "$out/gpu-worker.log" 2>&1 &
gp=$!
$b/bin/pinfer-cpu-worker --model "$model" --segment $seg --threads "${CPU_THREADS:-14}" \
  --metrics-port 127.0.0.1:0 --metrics-port-file "$dir/cpu.mport" \
  ${CPU_FLAGS:-} > "$out/cpu-worker.log" 2>&1 &
cp=$!
gpu_used() {
  command -v nvidia-smi > /dev/null &&
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1 || echo 0
}
rss() { awk '/^VmRSS/ {print $2}' /proc/$1/status 2>/dev/null || echo 0; }
# seconds since start, gpu-worker RSS KiB, cpu-worker RSS KiB, GPU MiB used
(while kill -0 $gp 2>/dev/null; do
  echo "$(minus "$(now)" "$t0") $(rss $gp) $(rss $cp) $(gpu_used)"
  sleep 0.5
done) > "$out/memory.tsv" &
sampler=$!
for i in $(seq 1200); do [[ -s $dir/gpu.port ]] && break; kill -0 $gp 2>/dev/null || break; sleep 0.5; done
if [[ ! -s $dir/gpu.port ]]; then
  echo "the gpu-worker did not start:"; tail -20 "$out/gpu-worker.log"; tail -5 "$out/cpu-worker.log"
  kill $gp $cp 2>/dev/null; exit 1
fi
t_gpu=$(now)
$b/bin/pinfer-gateway --workers "127.0.0.1:$(cat "$dir/gpu.port")" --listen 127.0.0.1:0 \
  --port-file "$dir/gw.port" --http-port 0 --http-port-file "$dir/http.port" \
  > "$out/gateway.log" 2>&1 &
gw=$!
for i in $(seq 600); do [[ -s $dir/http.port ]] && break; sleep 0.1; done
http=http://127.0.0.1:$(cat "$dir/http.port")
for i in $(seq 1200); do
  curl -sf "$http/health" > /dev/null && break
  sleep 0.1
done
t_ready=$(now)
curl -sN "$http/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "The capital of France is", "max_tokens": 64, "temperature": 0, "stream": true}' |
  while IFS= read -r line; do [[ $line == data:* ]] && echo "$(now) $line"; done > "$out/stream.txt"
t_done=$(now)
sleep 1
{
  echo "model: $(ls -la "$model" | awk '{print $5}') bytes, $dtype; $(grep -m1 wrote "$out/synthetic.log" 2>/dev/null)"
  echo "workers started at $(date -d "@$t0" +%T.%3N) (the log lines below carry the wall clock)"
  echo "gpu-worker serving: $(minus "$t_gpu" "$t0") s after the start"
  echo "gateway healthy (workers attached): $(minus "$t_ready" "$t0") s"
  first=$(grep -v '\[DONE\]' "$out/stream.txt" | head -1 | cut -d' ' -f1)
  last=$(grep -v '\[DONE\]' "$out/stream.txt" | tail -1 | cut -d' ' -f1)
  n=$(grep -vc '\[DONE\]' "$out/stream.txt")
  echo "first token: $(minus "$first" "$t0") s after the start ($(minus "$first" "$t_ready") s after the request)"
  echo "decode: $n chunks, $(awk -v n="$n" -v a="$first" -v b="$last" 'BEGIN { printf "%.2f", (n - 1) / (b - a) }') tokens/s (first to last chunk)"
  echo "peak resident memory: gpu-worker $(awk '/^VmHWM/ {print $2/1048576 " GiB"}' /proc/$gp/status)," \
    "cpu-worker $(awk '/^VmHWM/ {print $2/1048576 " GiB"}' /proc/$cp/status)"
  echo "GPU memory used, peak of the samples: $(sort -k4 -n "$out/memory.tsv" | tail -1 | awk '{print $4}') MiB"
  free -m | sed -n 1,2p
  echo "== gpu-worker"
  grep -E "placement|VRAM|CUDA backend|cold prefill: --|loaded|model|serving|attached" "$out/gpu-worker.log" |
    grep -v "placement:   layer" | head -24
  echo "== cpu-worker"
  grep -E "rows|attached|serving|model|placement" "$out/cpu-worker.log" | head -12
} | tee "$out/summary.txt"
# Steady state: REPEATS more streamed completions after the first; each one's median time
# between chunks (one chunk a token) is what a user's decode feels like.
for r in $(seq "${REPEATS:-3}"); do
  curl -sN "$http/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "The capital of France is", "max_tokens": 64, "temperature": 0, "stream": true}' |
    while IFS= read -r line; do [[ $line == data:* ]] && echo "$(now) $line"; done > "$out/stream-$r.txt"
  grep -v '\[DONE\]' "$out/stream-$r.txt" | awk '{print $1}' |
    awk 'NR > 1 { print ($1 - p) * 1000 } { p = $1 }' | sort -n |
    awk -v r="$r" '{ v[NR] = $1 } END { printf "repeat %d: median %.1f ms between tokens (%.1f tok/s), min %.1f, max %.1f\n", r, v[int((NR + 1) / 2)], 1000 / v[int((NR + 1) / 2)], v[1], v[NR] }' |
    tee -a "$out/summary.txt"
done
echo "cpu-worker threads ${CPU_THREADS:-14} ${CPU_FLAGS:-}; gpu-worker ${GPU_FLAGS:---gpu-slots 2 --max-context 4096}" |
  tee -a "$out/summary.txt"
# The predicted-active share the construction aims at (10% of neurons) and where they ran.
curl -s "http://127.0.0.1:$(cat "$dir/gpu.mport")/metrics" > "$out/gpu-worker.metrics"
curl -s "http://127.0.0.1:$(cat "$dir/cpu.mport")/metrics" > "$out/cpu-worker.metrics"
# The gpu-worker's wait for each exchange against the cpu-worker's compute inside it: the rest is
# the handoff (shared memory, wake-ups).
grep -E '^pinfer_worker_exchange_compute_seconds_(sum|count)|^pinfer_worker_neurons_(listed|computed)_total' "$out/cpu-worker.metrics" |
  tee -a "$out/summary.txt"
grep -E '^pinfer_worker_ffn_sparsity|^pinfer_worker_neurons_computed_total|^pinfer_worker_cold_gpu_share_neurons_total|^pinfer_worker_shm_wait_seconds_(sum|count)|^pinfer_worker_shm_wait_seconds_total|^pinfer_worker_compute_seconds_total' \
  "$out/gpu-worker.metrics" | tee -a "$out/summary.txt"
kill $gw $gp $cp 2>/dev/null
wait $gw $gp $cp 2>/dev/null
kill $sampler 2>/dev/null
exit 0
