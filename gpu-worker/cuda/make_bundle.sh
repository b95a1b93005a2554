#!/bin/bash
# Packs the CUDA module, its op tests, backend test and benchmarks (bench/cuda), with every shared
# library they need that a bare GPU machine (CUDA toolkit and driver only: no Abseil, gRPC,
# sentencepiece or GoogleTest) lacks, into one folder that device_run.sh runs from. cuBLAS and the
# driver are taken from the GPU machine; glibc and libstdc++ there must be at least as new as here.
#
#   gpu-worker/cuda/make_bundle.sh BUILD_DIR OUT_DIR
set -euo pipefail
build=${1:?build dir}
out=${2:?output dir}
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
# The tokenizer loads sentencepiece from its own module, found beside ../lib of the executable.
spm=$(find "$build" -name libpinfer_spm.so -print -quit)
bins=(
  ${spm:+"$spm"}
  "$build/tests/cuda/cuda_ops_test"
  "$build/tests/cuda/cuda_backend_test"
  "$build/bench/cuda/cuda_decode_bench"
  "$build/bench/cuda/cuda_prefill_bench"
  "$build/bench/cuda/cuda_adaptive_bench"
  "$build/bench/cuda/cuda_kernel_bench"
  "$build/gpu-worker/cuda/libpinfer_cuda.so"
)
for b in "${bins[@]}"; do
  cp "$b" "$out/bin/"
  strip --strip-unneeded "$out/bin/$(basename "$b")" 2>/dev/null || true
done
# Libraries the GPU machine provides itself (system, C++ runtime, CUDA driver and cuBLAS).
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libcublas\.so|libcublasLt\.so)'
for b in "${bins[@]}"; do
  ldd "$b" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    if [[ ! $name =~ $skip ]]; then cp -L "$path" "$out/lib/$name"; fi
  done
done
if [[ -n $spm ]]; then mv "$out/bin/libpinfer_spm.so" "$out/lib/"; fi
du -sh "$out"
