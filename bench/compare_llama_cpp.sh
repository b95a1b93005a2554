#!/usr/bin/env bash
# Side-by-side single-thread speed of pinfer and llama.cpp on the same GGUF files.
#
# Makes a random-weight ~91M-parameter SiLU Llama (bench/make_random_llama.py), converts it with
# `pinfer convert` to F16, Q8_0, Q4_0 and the K mixes Q4_K_M, Q5_K_M and Q6_K, then for each format alternates pinfer's engine_bench and
# llama.cpp (node-llama-cpp 3.21.1's prebuilt CPU build, bench/llama_cpp/bench.mjs) over the same
# prompt ids, ROUNDS times, and prints a Markdown table of medians and ratios.
#
# usage: [FORMATS="f16 q4_k_m ..."] bench/compare_llama_cpp.sh [BUILD_DIR] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
ROUNDS=${2:-3}
PROMPT=128
DECODE=64
# The K types are llama.cpp's quantize mixes, as `pinfer convert` writes them.
FORMATS=${FORMATS:-"f16 q8_0 q4_0 q4_k_m q5_k_m q6_k"}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if [ ! -d bench/llama_cpp/node_modules/node-llama-cpp ]; then
  (cd bench/llama_cpp && npm i -E --omit=optional --no-audit --no-fund \
     node-llama-cpp@3.21.1 @node-llama-cpp/linux-x64@3.21.1 >/dev/null)
fi
/usr/bin/python3 bench/make_random_llama.py "$WORK/hf" >/dev/null
for t in $FORMATS; do
  "$BUILD/cli/pinfer" convert --model "$WORK/hf" --out "$WORK/model-$t.gguf" --type "$t" >/dev/null
done

median() { /usr/bin/python3 -c 'import sys,statistics; print(f"{statistics.median(map(float, sys.argv[1:])):.1f}")' "$@"; }
values() { /usr/bin/python3 -c 'import sys,json; print(" ".join(str(x) for x in json.loads(sys.argv[1])[sys.argv[2]]))' "$1" "$2"; }

# Per-round decode ratios (each round runs the two engines back to back) show the spread.
ratio_range() { /usr/bin/python3 -c 'import sys; a, b = (list(map(float, s.split())) for s in sys.argv[1:3]); r = [x / y for x, y in zip(a, b)]; print(f"{min(r):.2f}-{max(r):.2f}")' "$1" "$2"; }

echo "| format | pinfer prompt tok/s | llama.cpp prompt tok/s | ratio | pinfer decode tok/s | llama.cpp decode tok/s | ratio | per-round decode ratios |"
echo "|---|---|---|---|---|---|---|---|"
for t in $FORMATS; do
  pp=() lp=() pd=() ld=()
  for r in $(seq "$ROUNDS"); do
    a=$("$BUILD/bench/engine_bench" "$WORK/model-$t.gguf" $PROMPT $DECODE 1 1)
    b=$(node bench/llama_cpp/bench.mjs "$WORK/model-$t.gguf" $PROMPT $DECODE 1 1)
    pp+=($(values "$a" prompt_tokens_per_second)); pd+=($(values "$a" decode_tokens_per_second))
    lp+=($(values "$b" prompt_tokens_per_second)); ld+=($(values "$b" decode_tokens_per_second))
  done
  mpp=$(median "${pp[@]}"); mlp=$(median "${lp[@]}"); mpd=$(median "${pd[@]}"); mld=$(median "${ld[@]}")
  echo "| ${t^^} | $mpp | $mlp | $(/usr/bin/python3 -c "print(f'{$mpp/$mlp:.2f}')") | $mpd | $mld | $(/usr/bin/python3 -c "print(f'{$mpd/$mld:.2f}')") | $(ratio_range "${pd[*]}" "${ld[*]}") |"
done
echo
echo "Command: bench/compare_llama_cpp.sh $BUILD $ROUNDS  (prompt $PROMPT tokens, decode $DECODE tokens, 1 thread, medians of $ROUNDS alternating rounds)"
