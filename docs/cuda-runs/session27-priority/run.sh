#!/bin/bash
# Session 27, second call: the guess's stream at the device's highest priority (layer graphs
# instantiated with their nodes' priorities) and joined before the FFN norm, so the guess always
# reaches the host before x. The op and backend tests; a probe of the guess's size against its
# shift on the bench's random predictors; then one F16 sequence at skew 20%: base, the module's
# guess alone, the bench's drawn guess (recall 0.95 at 1.2x, pinned prefetcht0 loads), and both.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
for t in cuda_ops_test cuda_backend_test; do
  PINFER_CUDA_MODULE=/tmp/s/cudamod/bin/libpinfer_cuda.so PINFER_MODELS_DIR="$PWD/models" timeout 250 $bin/$t > $out/$t.log 2>&1
  echo "== $t: rc $? at $((SECONDS - start)) s"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran|^guess:" $out/$t.log
  grep -B3 -A12 "Failure" $out/$t.log | head -40
done
g="COLD_GUESS=1+COLD_GUESS_SHIFT"
timeout 150 $bin/cuda_decode_bench --dtype=F16 --modes=pinfer --variant-modes=pinfer \
  --variants="$g=0;$g=-1;$g=-2;$g=-4;$g=-8" --rounds=1 --skews=0.2 --steps=8 --warmup=4 \
  > $out/probe_F16.log 2>&1
echo "== probe: rc $? at $((SECONDS - start)) s"
grep -E "guess waited" $out/probe_F16.log | sed 's/.*\[\(.*\)\].*guess waited for \(.*\)/\1: \2/'
p="+COLD_AHEAD_PIN=1+COLD_AHEAD_HINT=3"
left=$(( 570 - (SECONDS - start) ))
(( left < 90 )) && { echo "no time left for the bench"; exit 0; }
timeout $left $bin/cuda_decode_bench --dtype=F16 --modes=pinfer --variant-modes=pinfer \
  --variants="base;$g=-2;COLD_AHEAD=0.95:1.2$p;$g=-2+COLD_AHEAD=0.95:1.2$p" \
  --rounds=2 --skews=0.2 --steps=48 --warmup=16 > $out/bench_F16.log 2>&1
echo "== bench F16: rc $? at $((SECONDS - start)) s"
grep -E "^cold rows|bandwidth after|guess waited" $out/bench_F16.log | cut -c1-400
sed -n '/^Over the rounds/,$p' $out/bench_F16.log
