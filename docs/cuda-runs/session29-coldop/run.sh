#!/bin/bash
# Session 29, scratch call: one thread's share of a layer's cold op with its rows in cache,
# Q4_0 against F16, on the H200's host (AVX-512; this development machine has AVX2 only). The
# program is coldop.cc in this folder, built here against build/'s libraries:
#   g++ -O3 -std=gnu++20 -I. coldop.cc -o .device/coldop <ffn_bench's LINK_LIBRARIES>
# and run with the absl libraries of the module bundle (gpu-worker/cuda/make_bundle.sh).
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
for k in 8 22 45; do
  LD_LIBRARY_PATH=/tmp/s/cudamod/lib taskset -c 3 .device/coldop $k
done 2>&1 | tee $out/coldop.log
