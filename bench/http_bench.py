#!/usr/bin/env python3
"""The HTTP API's per-token cost against gRPC's (issue 42: within 5%), on one `pinfer serve`.

Both paths stream the same greedy generation (ignore_eos, so every stream has the same length):
gRPC Generate from Python (Debian's python3-grpcio, stubs generated from proto/ as in
examples/python) and POST /v1/completions with stream=true as server-sent events, read with the
standard library. The HTTP API calls the gateway's gRPC API in-process, so the difference is the
HTTP layer alone: parsing, JSON chunks and the extra hop. Rounds alternate the two paths so that
drift (thermal, other load) hits both; the table gives medians over rounds of the decode time
per token (first token to last, over tokens - 1) and of the whole request, and the ratios.

    python3 bench/http_bench.py --pinfer build/cli/pinfer --model models/relu-llama-tiny \
        [--tokens 256] [--rounds 9] [--prompt "Once upon a time"]
"""

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples", "python"))
import pinfer_client  # noqa: E402
from bench_util import wait_for_file  # noqa: E402


def grpc_stream(client, prompt, tokens):
    """(seconds per decoded token, total seconds, tokens) of one gRPC Generate stream."""
    req = client.pb.GenerateRequest(prompt=prompt, max_new_tokens=tokens, ignore_eos=True,
                                    sampling=client.pb.SamplingParams(temperature=0))
    start = time.perf_counter()
    first = last = None
    n = 0
    for resp in client.stub.Generate(req, timeout=300):
        if resp.tokens:
            last = time.perf_counter()
            first = first or last
            n += len(resp.tokens)
    end = time.perf_counter()
    return (last - first) / max(n - 1, 1), end - start, n


def http_stream(port, prompt, tokens):
    """The same over POST /v1/completions with stream=true (one kept-alive connection)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]}")
    first = last = None
    n = 0
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):  # a chunk may carry several tokens (or bytes of one)
            n = chunk["usage"]["completion_tokens"]
        if any(c.get("text") for c in chunk["choices"]):
            last = time.perf_counter()
            first = first or last
    end = time.perf_counter()
    conn.close()
    return (last - first) / max(n - 1, 1), end - start, n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pinfer", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--serve-args", default="", help="extra flags for pinfer serve")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "py"))
        pinfer_client.generate_stubs(os.path.join(d, "py"))
        log = open(os.path.join(d, "serve.log"), "w")
        serve = subprocess.Popen(
            [a.pinfer, "serve", "--model", a.model, "--host", "127.0.0.1", "--port", "0",
             "--port-file", os.path.join(d, "port"), "--http-port", "0",
             "--http-port-file", os.path.join(d, "hport")] + a.serve_args.split(),
            stdout=log, stderr=subprocess.STDOUT)
        try:
            port = wait_for_file(os.path.join(d, "port"))
            hport = wait_for_file(os.path.join(d, "hport"))
            client = pinfer_client.Client(f"127.0.0.1:{port}", timeout=300)
            end = time.time() + 60
            while True:  # ready once a one-token request succeeds
                try:
                    client.generate(prompt="Once", max_new_tokens=1)
                    break
                except Exception:
                    if time.time() > end:
                        raise
                    time.sleep(0.2)
            grpc_stream(client, a.prompt, 16)  # warm-up, both paths
            http_stream(hport, a.prompt, 16)
            rows = {"grpc": [], "http": []}
            for r in range(a.rounds):
                order = [("grpc", lambda: grpc_stream(client, a.prompt, a.tokens)),
                         ("http", lambda: http_stream(hport, a.prompt, a.tokens))]
                for name, run in (order if r % 2 == 0 else order[::-1]):
                    per_token, total, n = run()
                    if n != a.tokens:
                        raise RuntimeError(f"{name} streamed {n} tokens, not {a.tokens}")
                    rows[name].append((per_token, total))
        finally:
            serve.terminate()
            serve.wait(timeout=30)
            log.close()
    med = {k: (statistics.median(p for p, _ in v), statistics.median(t for _, t in v))
           for k, v in rows.items()}
    print(f"command: {' '.join(sys.argv)}")
    print(f"{a.tokens} tokens per stream, {a.rounds} rounds per path, medians")
    print(f"{'path':<6} {'us/token (decode)':>18} {'ms/request':>11}")
    for k in ("grpc", "http"):
        print(f"{k:<6} {med[k][0] * 1e6:>18.1f} {med[k][1] * 1e3:>11.1f}")
    print(f"http/grpc ratio: per token {med['http'][0] / med['grpc'][0]:.3f}, "
          f"per request {med['http'][1] / med['grpc'][1]:.3f}")


if __name__ == "__main__":
    main()
