#!/bin/bash
# Packs the build dependencies that a bare GPU machine lacks (it has CUDA, CMake, ninja and g++,
# but no Abseil, RE2, sentencepiece, nlohmann-json or GoogleTest) from this Debian 12 machine into
# a relocatable prefix, so that device_build_run.sh can configure and build pinfer's engine, the
# CUDA module, its tests and benchmarks on the GPU machine itself. The service (gRPC, protobuf,
# prometheus-cpp) is not needed for that; its binaries travel prebuilt (bench/make_service_bundle.sh).
#
#   gpu-worker/cuda/make_device_sdk.sh OUT_DIR        # about 10 MB; OUT_DIR/usr is the prefix
#
# Debian's CMake package files compute their prefix from their own location, so the copied tree
# works wherever it lands. Shared libraries come along for runtime too (LD_LIBRARY_PATH).
set -euo pipefail
out=${1:?output dir}
lib=/usr/lib/x86_64-linux-gnu
rm -rf "$out"
mkdir -p "$out/usr/include" "$out/usr/lib/x86_64-linux-gnu/cmake" "$out/usr/share/cmake"
cp -r /usr/include/absl /usr/include/gtest /usr/include/gmock /usr/include/nlohmann \
  /usr/include/re2 "$out/usr/include/"
cp /usr/include/sentencepiece_processor.h /usr/include/sentencepiece_trainer.h "$out/usr/include/"
cp -r $lib/cmake/absl $lib/cmake/GTest "$out/usr/lib/x86_64-linux-gnu/cmake/"
cp -r /usr/share/cmake/nlohmann_json "$out/usr/share/cmake/"
# Real files only: the device transfer may not keep symbolic links inside carried folders, and
# copies under every name would double the size. links.txt lists the soname and unversioned
# names that device_build_run.sh links to each library before it builds.
for f in $lib/libabsl_*.so.*.*.* $lib/libre2.so.*.*.* $lib/libsentencepiece.so.*.*.*; do
  name=$(basename "$f")
  cp "$f" "$out/usr/lib/x86_64-linux-gnu/"
  echo "$name $(objdump -p "$f" | awk '/SONAME/ {print $2}') ${name%%.so.*}.so" >> "$out/links.txt"
done
cp $lib/libgtest*.a $lib/libgmock*.a "$out/usr/lib/x86_64-linux-gnu/"
du -sh "$out"
