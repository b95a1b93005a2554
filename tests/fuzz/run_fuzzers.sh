#!/bin/bash
# Builds every libFuzzer target of the repository with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer in its own build directory, then runs each for a bounded time from its
# seed corpus: the GGUF, safetensors and config.json parsers (tests/fuzz, seeds in
# tests/fuzz/corpus) and the tokenizer.json / byte-level BPE fuzzers (tests/tokenizer, seeds in
# tests/tokenizer/corpus). Exits non-zero if any fuzzer finds a crash, a leak, undefined behaviour
# or a timeout; the reproducer is left in $BUILD/fuzz-artifacts/.
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
# target  folder (under tests/)  seed corpus (under tests/)
FUZZERS=(
  "gguf_fuzzer fuzz fuzz/corpus/gguf"
  "safetensors_fuzzer fuzz fuzz/corpus/safetensors"
  "config_fuzzer fuzz fuzz/corpus/config"
  "tokenizer_json_fuzzer tokenizer tokenizer/corpus/tokenizer_json"
  "bpe_encode_fuzzer tokenizer tokenizer/corpus/bpe_encode"
)
targets=()
for f in "${FUZZERS[@]}"; do
  read -r target _ _ <<<"$f"
  targets+=("$target")
done
ninja -C "$BUILD" -j "$JOBS" "${targets[@]}"

mkdir -p "$BUILD/fuzz-artifacts"
status=0
for f in "${FUZZERS[@]}"; do
  read -r name folder seeds <<<"$f"
  # New inputs go to a scratch corpus; the checked-in seeds stay as they are.
  work=$(mktemp -d)
  dict=()
  [[ -f "$ROOT/tests/$folder/${name%_fuzzer}.dict" ]] && dict=(-dict="$ROOT/tests/$folder/${name%_fuzzer}.dict")
  corpus=("$work")
  [[ -d "$ROOT/tests/$seeds" ]] && corpus+=("$ROOT/tests/$seeds")
  echo "== $name for ${SECONDS_EACH}s"
  if ! "$BUILD/tests/$folder/$name" "${dict[@]}" -max_total_time="$SECONDS_EACH" \
      -max_len=65536 -timeout=20 -rss_limit_mb=3072 -print_final_stats=1 \
      -artifact_prefix="$BUILD/fuzz-artifacts/${name}-" "${corpus[@]}" \
      2>"$BUILD/fuzz-artifacts/${name}.log"; then
    echo "$name FAILED (log: $BUILD/fuzz-artifacts/${name}.log)"
    tail -40 "$BUILD/fuzz-artifacts/${name}.log"
    status=1
  else
    grep -E "stat::number_of_executed_units|cov:" "$BUILD/fuzz-artifacts/${name}.log" | tail -2
  fi
  rm -rf "$work"
done
exit $status
