#!/bin/bash
# Packs the service binaries (pinfer, gateway, both workers, service_bench) with every shared
# library they need beyond glibc/libstdc++ into one folder, so that the service benchmark runs on
# a machine without gRPC, protobuf, prometheus-cpp or Abseil installed (e.g. a GPU host):
#
#   bench/make_service_bundle.sh BUILD_DIR OUT_DIR
#   LD_LIBRARY_PATH=OUT_DIR/lib OUT_DIR/bin/service_bench --pinfer OUT_DIR/bin/pinfer ...
set -euo pipefail
build=${1:?build dir}
out=${2:?output dir}
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
bins=("$build/cli/pinfer" "$build/bin/pinfer-gateway" "$build/bin/pinfer-gpu-worker"
      "$build/bin/pinfer-cpu-worker" "$build/bench/service_bench" "$build/bench/sparse/synthetic_pwri"
      "$build/bench/exchange_bench" "$build/bench/thread_pool_bench"
      "$build/bench/sparse/cold_rows_bench" "$build/bin/libpinfer_spm.so")
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libstdc\+\+\.so|libgcc_s\.so)'
for b in "${bins[@]}"; do
  cp "$b" "$out/bin/"
  strip --strip-unneeded "$out/bin/$(basename "$b")" 2>/dev/null || true
  ldd "$b" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    if [[ ! $name =~ $skip ]]; then cp -L "$path" "$out/lib/$name"; fi
  done
done
mv "$out/bin/libpinfer_spm.so" "$out/lib/"
du -sh "$out"
