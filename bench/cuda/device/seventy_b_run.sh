#!/bin/bash
# Issue 43's 70B figures: ReluLLaMA-70B's shape (80 layers, hidden 8192, 64 heads, 8 KV heads,
# FFN 28672, vocab 32000) in Q4_0 and Q4_K (DTYPES, default both; Q4_K stands for Q4_K_M, whose
# other tensors are a few percent of its bytes), synthetic weights built in host memory, the weights' VRAM
# budget 22 GB (a 24 GB card less the KV cache and buffers). One sequence (pinfer, dense layer
# offload, the whole model) at skews 20% and 40%; two lanes; prompt processing at 256 and 1024
# tokens with the cost model's choice. F16 (138 GB) and Q8_0 (73 GB) do not fit the device's
# 128 GB of host memory twice over (the bench keeps the model and the cold side's row copy).
# Run from the repository root on the device, with the bundle made here by
#
#   gpu-worker/cuda/make_bundle.sh build .device/bundle
#   (cd .device && tar -cf - bundle | xz -T2 -3 > bundle.tar.xz)
#
#   bench/cuda/device/seventy_b_run.sh OUT
set -u
out=${1:?output dir}
mkdir -p "$out" /tmp/b
[ -d /tmp/b/bundle ] || tar -xJf .device/bundle.tar.xz -C /tmp/b
shape="--layers=80 --hidden=8192 --ffn=28672 --heads=64 --kv-heads=8 --vocab=32000 --budget-gb=22"
# The tests first (device_run.sh, SKIP_TESTS=1 skips them), then the one-sequence modes.
dtypes=${DTYPES:-Q4_0 Q4_K}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  BENCH_DTYPES="" LANES_DTYPES="" gpu-worker/cuda/device_run.sh /tmp/b/bundle "$out"
fi
B=/tmp/b/bundle
export LD_LIBRARY_PATH=$B/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
for dt in $dtypes; do
  timeout 420 $B/bin/cuda_decode_bench --dtype=$dt --rounds=1 $shape --warmup=2 --steps=12 \
    2>&1 | tee "$out/bench_${dt}_70b.log"
  [ "${LANES:-1}" = 1 ] && timeout 280 $B/bin/cuda_decode_bench --dtype=$dt --rounds=1 $shape \
    --warmup=2 --steps=12 --modes=lanes 2>&1 | tee "$out/lanes_${dt}_70b.log"
  [ "${PREFILL:-1}" = 1 ] && timeout 280 $B/bin/cuda_prefill_bench --dtype=$dt $shape \
    --prefill-batches=256,1024 2>&1 | tee "$out/prefill_${dt}_70b.log"
done
