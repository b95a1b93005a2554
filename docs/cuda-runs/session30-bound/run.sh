#!/bin/bash
# Session 30, second call: an upper bound for staging guessed cold rows in VRAM. The GPU's share
# of each layer's active cold neurons (COLD_GPU_SHARE=F: the first F of the list) is read from a
# device copy of the cold rows (new measurement knob COLD_ROWS_ON_DEVICE=1), as if those rows had
# been copied to the GPU ahead of their layer at no cost; the CPU computes the rest. Against the
# same share read from pinned host memory over PCIe (the product's --cold-gpu-share). One
# sequence, skew 20%. Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod.
# Not a result: this call's host was disturbed (the cold-rows line at 16-52 GB/s, base tokens/s
# ranging 2-3x within the process), and the knob (a cudaMalloc'd copy in ColdStreamer::PinRows)
# was removed uncommitted; the staged mode (session30-staged) measures the same question better.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
v="+COLD_ROWS_ON_DEVICE=1"
for d in Q4_0 F16; do
  LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 280 $bin/cuda_decode_bench --dtype=$d --modes=pinfer \
    --variant-modes=pinfer --rounds=3 --skews=0.2 --steps=48 --warmup=16 \
    --variants="base;COLD_GPU_SHARE=0.3;COLD_GPU_SHARE=0.3$v;COLD_GPU_SHARE=0.5$v;COLD_GPU_SHARE=0.7$v" \
    > $out/bench_$d.log 2>&1
  echo "== bench $d: rc $? at $((SECONDS - start)) s"
  grep -E "^cold rows|bandwidth after" $out/bench_$d.log | cut -c1-330
  sed -n '/^Over the rounds/,$p' $out/bench_$d.log
done
