#!/usr/bin/env bash
# Installs dependencies, builds, and runs every test: the full suite (ctest), then the engine's
# tests again under AddressSanitizer + UndefinedBehaviorSanitizer and the concurrent parts under
# ThreadSanitizer, then a bounded fuzzing pass over the file parsers.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
# llama.cpp (node-llama-cpp's prebuilt CPU build, pinned in bench/llama_cpp) for the test that it
# loads pinfer-converted GGUF files; that test skips when npm cannot provide it.
if command -v npm >/dev/null && [ ! -d bench/llama_cpp/node_modules/node-llama-cpp ]; then
  (cd bench/llama_cpp && npm ci --omit=optional --no-audit --no-fund --ignore-scripts >/dev/null) ||
    echo "warning: could not install node-llama-cpp; the llama.cpp compatibility test will skip"
fi
# @huggingface/jinja (pinned in tests/chat), the reference renderer the chat template golden
# outputs come from; its live re-check is left out of ctest when npm cannot provide it.
if command -v npm >/dev/null && [ ! -d tests/chat/node_modules/@huggingface/jinja ]; then
  (cd tests/chat && npm ci --no-audit --no-fund --ignore-scripts >/dev/null) ||
    echo "warning: could not install @huggingface/jinja; the live chat template reference check will skip"
fi
# The official OpenAI client and puppeteer-core (pinned in tests/http) for the HTTP API and chat
# page tests, which skip without them.
if command -v npm >/dev/null && [ ! -d tests/http/node_modules/openai ]; then
  (cd tests/http && npm ci --no-audit --no-fund --ignore-scripts >/dev/null) ||
    echo "warning: could not install the HTTP tests' npm packages; those tests will skip"
fi
scripts/build.sh

echo "== full test suite"
ctest --test-dir build --output-on-failure -j 2 --timeout 1500

echo "== ASan + UBSan (engine, model loading, tokenizers)"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPINFER_ASAN=ON \
  -DPINFER_SERVICE=OFF -DPINFER_CUDA=OFF >/dev/null
cmake --build build-asan -j "$(nproc)"
# The held-out perplexity and the NumPy family check are already covered above and are slow
# under ASan.
ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan --output-on-failure -j 2 --timeout 1500 \
  -E "HeldOut|Perplexity|model_family"

echo "== TSan (thread pool, sparse kernels, the gpu-worker's scheduler and decode lanes, the"
echo "   shared-memory exchange and its guesses, the cold rows loaded ahead, the adaptive hot"
echo "   set's counting thread, the HTTP hang-up watch)"
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPINFER_TSAN=ON \
  -DPINFER_SERVICE=OFF -DPINFER_CUDA=OFF >/dev/null
cmake --build build-tsan -j "$(nproc)" --target thread_pool_test ops_test scheduler_test prefix_cache_test \
  lane_threads_test shm_test ffn_split_test hot_cache_test hangup_watch_test
# The exchange tests that fork a peer process are left out: TSan cannot fork a threaded process.
ctest --test-dir build-tsan --output-on-failure -R \
  "ThreadPool|OpsTest|SparseFfnTokenTest|SchedulerTest|PrefixCacheTest|LaneThreads|HangupWatch|WaitTest|FfnSplitTest|AdaptiveHotSet|ExchangeTest\.(RoundTrips|HandlerErrors|Guesses|RestartedPeer|ServerLetsGo)"

echo "== fuzzers (libFuzzer + ASan/UBSan, 60 s each)"
tests/fuzz/run_fuzzers.sh 60
