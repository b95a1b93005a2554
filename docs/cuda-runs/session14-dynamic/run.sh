#!/bin/bash
# Session 14: dense one-part products hand out their steps one at a time (QX_DYNAMIC); op and
# backend tests, then the whole Q4_0 model alternating; the key kernels' SASS for spills.
set -u
out=$1
BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=base;QX_DYNAMIC=0;base;QX_DYNAMIC=0" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/cuda_ops_test.log $out/cuda_backend_test.log; do grep -E "PASSED|FAILED|Failure" $f | head; done
cat $out/cuda_ops_test.log $out/cuda_backend_test.log | grep -E "(QuantRegs|FusedNorm|RopeInProduct|QuantizedModelStep).*(OK|FAILED)|Failure|Expected|Which is|NMSE" | head -20
for f in $out/bench_*.log; do grep -E "^\| |GPU busy" $f | grep -v "^| dtype\|^|---" | cut -d'|' -f2,3,4,6,7 | cut -c1-120; done
CU=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
$CU -sass /tmp/pinfer-cuda-build/gpu-worker/cuda/libpinfer_cuda.so > $out/all.sass 2>/dev/null
for k in ELi5ELi1ELb1ELb1ELi1E ELi5ELi1ELb1ELb1ELi0E ELi5ELi1ELb1ELb0ELi0E; do
  awk -v k="$k" '/Function : /{f = (index($0, "MatVecQxRegsKernelILNS0_5WTypeE4ELi") > 0 && index($0, k) > 0)} f' $out/all.sass > $out/k_$k.sass
  echo "$k: $(wc -l < $out/k_$k.sass) lines, STL $(grep -c STL $out/k_$k.sass), LDL $(grep -c LDL $out/k_$k.sass)"
done
rm -f $out/all.sass
