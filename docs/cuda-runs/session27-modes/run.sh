#!/bin/bash
# Session 27, fifth call: the guess made in either of two places. session27-fork made layer l's
# guess from the residual plus layer l - 1's hot part, its predictor forked first in layer l's
# work: the attention phase grew by 0.27 ms a token. PINFER_CUDA_COLD_GUESS_EARLY=1 makes it from
# the residual after layer l - 1's attention alone, beside layer l - 1's hot rows. The op and
# backend tests (the exact-guess test in both modes), then one F16 sequence at skew 20%: base,
# the bench's drawn guess (recall 0.95 at 1.2x, pinned prefetcht0 loads), and the drawn guess
# with the module's guess running in either mode. Bundle: cudamod of the work tree.
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
p="+COLD_AHEAD_PIN=1+COLD_AHEAD_HINT=3"
left=$(( 570 - (SECONDS - start) ))
(( left < 90 )) && { echo "no time left for the bench"; exit 0; }
timeout $left $bin/cuda_decode_bench --dtype=F16 --modes=pinfer --variant-modes=pinfer \
  --variants="base;COLD_AHEAD=0.95:1.2$p;$g=-4+COLD_AHEAD=0.95:1.2$p;$g=-4+COLD_GUESS_EARLY=1+COLD_AHEAD=0.95:1.2$p" \
  --rounds=3 --skews=0.2 --steps=48 --warmup=16 > $out/bench_F16.log 2>&1
echo "== bench F16: rc $? at $((SECONDS - start)) s"
grep -E "^cold rows|bandwidth after|guess waited" $out/bench_F16.log | cut -c1-400
sed -n '/^Over the rounds/,$p' $out/bench_F16.log
