#!/bin/bash
# Session 26: two lanes, session 25's code (oldmod: cuda_decode_bench and libpinfer_cuda.so built
# at 721d3e4) against this session's (cudamod, f484db7), as alternating processes, four per
# dtype: did ColdFfn::Ahead or the pool's pinned-chunk switch slow the lanes (session26-final's
# lanes were half their usual speed, session26-lanes' were not)? Per process `--modes=lanes`,
# skew 20%, three rounds.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
cat /proc/loadavg
for dt in Q4_0 F16; do
  for i in 1 2; do
    for v in oldmod cudamod; do
      left=$(( 540 - (SECONDS - start) ))
      (( left < 40 )) && { echo "skipped $dt $v $i"; continue; }
      LD_LIBRARY_PATH=/tmp/s/$v/lib timeout $(( left < 120 ? left : 120 )) \
        /tmp/s/$v/bin/cuda_decode_bench --dtype=$dt --modes=lanes --variant-modes=lanes \
        --variants="base" --rounds=3 --skews=0.2 --steps=48 --warmup=16 \
        > $out/${dt}_${v}_$i.log 2>&1
      echo "== $dt $v $i: rc $? at $((SECONDS - start)) s: $(grep -E '^\| .* lanes \| 20% \| base' $out/${dt}_${v}_$i.log)"
    done
  done
done
cat /proc/loadavg
tar -czf $out/logs.tgz -C $out $(cd $out && ls *.log) && rm -f $out/*_*.log
