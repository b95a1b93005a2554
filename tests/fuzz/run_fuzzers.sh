#!/bin/bash
# Builds the libFuzzer targets (GGUF, safetensors, config.json parsers) with clang, AddressSanitizer
# and UndefinedBehaviorSanitizer in their own build directory, then runs each for a bounded time
# from the seed corpus in tests/fuzz/corpus. Exits non-zero if any fuzzer finds a crash, a leak,
# undefined behaviour or a timeout; the reproducer is left in $BUILD/fuzz-artifacts/.
#
# usage: tests/fuzz/run_fuzzers.sh [SECONDS_PER_FUZZER]   (default 60)
# env:   PINFER_FUZZ_BUILD (build directory, default build-fuzz), PINFER_FUZZ_JOBS (ninja -j, 2)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${PINFER_FUZZ_BUILD:-$ROOT/build-fuzz}
SECONDS_EACH=${1:-60}
JOBS=${PINFER_FUZZ_JOBS:-2}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"

cmake -G Ninja -S "$ROOT" -B "$BUILD" \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPINFER_FUZZ=ON -DPINFER_CUDA=OFF \
  -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link $SAN" \
  -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link $SAN" \
  -DCMAKE_EXE_LINKER_FLAGS="$SAN" >/dev/null
ninja -C "$BUILD" -j "$JOBS" gguf_fuzzer safetensors_fuzzer config_fuzzer

mkdir -p "$BUILD/fuzz-artifacts"
status=0
for name in gguf safetensors config; do
  # New inputs go to a scratch corpus; the checked-in seeds stay as they are.
  work=$(mktemp -d)
  dict=()
  [[ -f "$ROOT/tests/fuzz/$name.dict" ]] && dict=(-dict="$ROOT/tests/fuzz/$name.dict")
  echo "== ${name}_fuzzer for ${SECONDS_EACH}s"
  if ! "$BUILD/tests/fuzz/${name}_fuzzer" "${dict[@]}" -max_total_time="$SECONDS_EACH" \
      -max_len=65536 -timeout=20 -rss_limit_mb=3072 -print_final_stats=1 \
      -artifact_prefix="$BUILD/fuzz-artifacts/${name}-" "$work" "$ROOT/tests/fuzz/corpus/$name" \
      2>"$BUILD/fuzz-artifacts/${name}.log"; then
    echo "${name}_fuzzer FAILED (log: $BUILD/fuzz-artifacts/${name}.log)"
    tail -40 "$BUILD/fuzz-artifacts/${name}.log"
    status=1
  else
    grep -E "stat::number_of_executed_units|cov:" "$BUILD/fuzz-artifacts/${name}.log" | tail -2
  fi
  rm -rf "$work"
done
exit $status
