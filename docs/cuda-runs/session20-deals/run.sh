#!/bin/bash
# Session 20, second call: the cold side alone (--modes=coldrows, CPU only) with three deals of
# the work to the threads (static shares + partials, dynamic groups + partials, columns: no
# partials), F16 and Q4_0. Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/cb/cudamod;
# tar -cJf .device/cudamod.tar.xz -C /tmp/cb cudamod
set -u
out=$1
mkdir -p /tmp/c && tar -xJf .device/cudamod.tar.xz -C /tmp/c
export LD_LIBRARY_PATH=/tmp/c/cudamod/lib:${LD_LIBRARY_PATH:-}
for dt in F16 Q4_0; do
  timeout 200 /tmp/c/cudamod/bin/cuda_decode_bench --dtype=$dt --modes=coldrows > $out/coldrows_$dt.log 2>&1
  echo "== coldrows $dt: rc $?"; cat $out/coldrows_$dt.log
done
# (The deals other than static were experiments of this session's working tree, not kept: the
# result that the dynamic deal of 8-neuron groups beat equal shares by 10-30% led to the
# cpu-worker's SparseFfnToken taking ~48 chunks from a spinning pool, which the bench's cold side
# now runs; see docs/benchmarks.md, run 34.)
