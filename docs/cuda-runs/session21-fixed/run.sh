#!/bin/bash
# Session 21, fifth call: the cold side alone (--modes=coldrows) with its new last line, the
# op's fixed costs measured one by one (the pool's empty loop, quantizing x, the partial sums'
# traffic), in Q4_0 and F16. Bundles: bench/make_service_bundle.sh build /tmp/svcb/svc;
# gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod; tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
for dt in Q4_0 F16; do
  timeout 120 /tmp/s/cudamod/bin/cuda_decode_bench --dtype=$dt --modes=coldrows > $out/coldrows_$dt.log 2>&1
  echo "== coldrows $dt: rc $?"; grep -E "^\|.*\| 16 \| |fixed costs" $out/coldrows_$dt.log
done
