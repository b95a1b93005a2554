#!/bin/bash
# Issue 41's device figures: K-quant whole-model decode against the GPU's bandwidth, and the hybrid
# (half the model's bytes as VRAM budget, skew 20% and 40%) for llama.cpp's Q4_K_M mix next to
# uniform Q4_K and Q4_0, one call, 13B shape (cuda_decode_bench --dtype=Q4_K_M: the output head
# and half of the layers' wv and ffn_down Q6_K, as `pinfer convert --type q4_k_m` types them).
# The issue asks for an H200; say which card ran each number. From the repository root on the
# device, with the service bundle's cudamod unpacked as seventy_b_service_run.sh expects:
#
#   bench/cuda/device/kquant_mix_run.sh OUT
set -u
out=$(realpath -m "${1:?output dir}")
mkdir -p "$out" /tmp/s
[ -d /tmp/s/cudamod ] || tar -xJf .device/svc-slim.tar.xz -C /tmp/s
B=/tmp/s/cudamod
export LD_LIBRARY_PATH=$B/lib:$B/bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for d in ${DTYPES:-Q4_K_M Q4_K Q4_0}; do
  modes=gpu,pinfer
  [ "$d" = Q4_K_M ] && modes=gpu,pinfer,offload
  left=$((${BUDGET_S:-580} - SECONDS))
  [ $left -lt 60 ] && { echo "skipped $d: ${left} s left"; continue; }
  timeout $((left < 200 ? left : 200)) "$B/bin/cuda_decode_bench" --dtype="$d" --rounds="${ROUNDS:-1}" \
    --modes=$modes > "$out/bench_$d.log" 2>&1
  echo "== $d rc=$? at ${SECONDS} s"
  grep -E "^\||^bandwidth|^model|per token cold" "$out/bench_$d.log" | head -30
done
