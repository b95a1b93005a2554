#!/usr/bin/env bash
# The main job: installs dependencies, builds, starts the full service (gateway, gpu-worker and
# cpu-worker as three supervised processes) on the bundled default model, and streams a
# generation through the public gRPC API from the Python client. Extra arguments go to the client
# (e.g. --prompt "..." --max-new-tokens 64 --temperature 0.8).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh

RUN_DIR=$(mktemp -d)
METRICS_PORT=${PINFER_METRICS_PORT:-9464}
build/cli/pinfer serve --model models/relu-llama-tiny --port 0 --port-file "$RUN_DIR/port" \
  --metrics-port "$METRICS_PORT" --bin-dir build/bin 2> "$RUN_DIR/serve.log" &
SERVE_PID=$!
cleanup() {
  kill -TERM "$SERVE_PID" 2>/dev/null || true
  wait "$SERVE_PID" 2>/dev/null || true
  rm -rf "$RUN_DIR"
}
trap cleanup EXIT

for _ in $(seq 300); do
  [ -s "$RUN_DIR/port" ] && break
  if ! kill -0 "$SERVE_PID" 2>/dev/null; then cat "$RUN_DIR/serve.log" >&2; exit 1; fi
  sleep 0.1
done
PORT=$(cat "$RUN_DIR/port")
# The gateway listens at once; it reports SERVING when its worker pair is up.
for _ in $(seq 300); do
  build/bin/pinfer-health-probe --addr "localhost:$PORT" --timeout 1 >/dev/null 2>&1 && break
  sleep 0.2
done
echo "pinfer is serving on localhost:$PORT (metrics: http://localhost:$METRICS_PORT/metrics)" >&2
if [ $# -eq 0 ]; then set -- --prompt "The Python interpreter" --max-new-tokens 64; fi
/usr/bin/python3 examples/python/pinfer_client.py --address "localhost:$PORT" "$@"
