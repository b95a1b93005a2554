#!/usr/bin/env bash
# Installs dependencies, builds, and runs every test (ctest), then the bounded fuzzing pass.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
cd build
ctest --output-on-failure -j 2 --timeout 1500
