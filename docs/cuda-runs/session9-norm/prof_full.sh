#!/bin/bash
# Scratch: Nsight Compute detail (speed of light, memory, warp stalls) of the whole-model Q4_0
# decode step's kernels on a 2-layer model of the 13B shape: the last layer's kernels of the
# last step (a first pass counts the matching launches).
set -u
out=$1
BENCH_DTYPES=" " OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 gpu-worker/cuda/device_build_run.sh .device/sdk $out/b > $out/b.log 2>&1
tail -3 $out/b.log
B=/tmp/pinfer-cuda-build/device-bundle
export LD_LIBRARY_PATH=$B/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PINFER_CUDA_PRELAUNCH=0
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
K='regex:MatVecSplitQ8x|NormKernel|Rope|Attention|Gated'
CMD="$B/bin/cuda_decode_bench --dtype=Q4_0 --modes=gpu --steps=1 --warmup=1 --layers=2"
timeout 150 $NCU --metrics gpu__time_duration.sum -k "$K" --csv --print-units base $CMD > $out/ncu_list.csv 2> $out/ncu_list.err
n=$(grep -c gpu__time_duration $out/ncu_list.csv)
echo "matching launches: $n"
grep gpu__time_duration $out/ncu_list.csv | tail -24 | cut -d, -f5,6,12- | cut -c1-200
timeout 300 $NCU --set full --cache-control all -k "$K" --launch-skip $((n - 10)) -c 10 $CMD \
  > $out/ncu_full_q4.txt 2> $out/ncu_full_q4.err
tail -3 $out/ncu_full_q4.err; wc -l $out/ncu_full_q4.txt
grep -E "^  [A-Za-z].*\(|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issued Ipc|Stall|Long Scoreboard|One or More" $out/ncu_full_q4.txt | head -150
