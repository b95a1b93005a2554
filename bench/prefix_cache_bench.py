#!/usr/bin/env python3
"""A chat's second turn over a 512-token history, with the prefix cache and without (issue 42).

Two `pinfer serve` deployments run side by side, one with the gpu-worker's prefix cache (the
default) and one with `--prefix-cache-entries 0`; requests go to one at a time, alternating
which goes first each round, so that drift hits both. A round sends each the same two turns:
turn 1 is a 448-token prompt (BOS and held-out text) answered with 64 greedy tokens, so the
history is 512 tokens; turn 2 re-sends that history plus 32 new tokens, as every chat client
does, and asks for 16 tokens. Every round uses a different stretch of text, so the only reuse
is turn 1's. The table gives medians over rounds of turn 2's time to first token (as the client
sees it, and the gateway's own timing), the prompt tokens the worker reused, and the ratio.

    python3 bench/prefix_cache_bench.py --pinfer build/cli/pinfer --model models/relu-llama-tiny \\
        [--rounds 7] [--serve-args "--threads 1"]
"""

import argparse
import array
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

HISTORY_PROMPT = 448  # turn 1's prompt; with its 64-token reply the history is 512 tokens
REPLY = 64
NEW_TOKENS = 32
TURN2_TOKENS = 16


def generate(client, ids, n):
    """(generated ids, client-side time to first token, the gateway's, cached prompt tokens)."""
    req = client.pb.GenerateRequest(token_ids=client.pb.TokenIds(ids=ids), max_new_tokens=n,
                                    ignore_eos=True,
                                    sampling=client.pb.SamplingParams(temperature=0))
    start = time.perf_counter()
    first = None
    out = []
    last = None
    for resp in client.stub.Generate(req, timeout=300):
        if resp.tokens and first is None:
            first = time.perf_counter() - start
        out.extend(t.id for t in resp.tokens)
        last = resp
    return (out, first, last.timings.time_to_first_token_seconds,
            last.usage.cached_prompt_tokens)


class Serve:
    def __init__(self, pinfer, model, d, name, extra):
        self.dir = os.path.join(d, name)
        os.makedirs(self.dir)
        self.log = open(os.path.join(self.dir, "serve.log"), "w")
        self.proc = subprocess.Popen(
            [pinfer, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
             "--port-file", os.path.join(self.dir, "port")] + extra,
            stdout=self.log, stderr=subprocess.STDOUT)

    def connect(self):
        port = wait_for_file(os.path.join(self.dir, "port"))
        self.client = pinfer_client.Client(f"127.0.0.1:{port}", timeout=300)
        end = time.time() + 60
        while True:  # ready once a one-token request succeeds
            try:
                self.client.generate(prompt="Once", max_new_tokens=1)
                return
            except Exception:
                if time.time() > end:
                    raise
                time.sleep(0.2)

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pinfer", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--serve-args", default="", help="extra flags for both pinfer serves")
    a = ap.parse_args()
    held = array.array("I")
    with open(os.path.join(a.model, "heldout-tokens.u32"), "rb") as f:
        held.frombytes(f.read())
    if sys.byteorder != "little":
        held.byteswap()
    stride = HISTORY_PROMPT + NEW_TOKENS
    if len(held) < (a.rounds + 1) * stride:
        raise RuntimeError("not enough held-out text for that many rounds")
    rows = {"cache": [], "none": []}
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "py"))
        pinfer_client.generate_stubs(os.path.join(d, "py"))
        extra = a.serve_args.split()
        serves = {"cache": Serve(a.pinfer, a.model, d, "cache", extra),
                  "none": Serve(a.pinfer, a.model, d, "none",
                                extra + ["--prefix-cache-entries", "0"])}
        try:
            for s in serves.values():
                s.connect()
            for r in range(a.rounds + 1):  # round 0 warms both up and is not counted
                off = r * stride
                turn1 = [1] + list(held[off:off + HISTORY_PROMPT - 1])
                new = list(held[off + HISTORY_PROMPT:off + stride])
                order = ["cache", "none"] if r % 2 == 0 else ["none", "cache"]
                outs = {}
                for name in order:
                    c = serves[name].client
                    reply, _, _, _ = generate(c, turn1, REPLY)
                    turn2 = turn1 + reply + new
                    ids, ttft, server_ttft, cached = generate(c, turn2, TURN2_TOKENS)
                    outs[name] = (reply, ids)
                    if r > 0:
                        rows[name].append((ttft, server_ttft, cached, len(turn2)))
                if outs["cache"] != outs["none"]:
                    raise RuntimeError(f"round {r}: the cache changed the generated tokens")
        finally:
            for s in serves.values():
                s.close()
    print(f"command: {' '.join(sys.argv)}")
    print(f"turn 2: a {HISTORY_PROMPT + REPLY}-token history + {NEW_TOKENS} new tokens, "
          f"{TURN2_TOKENS} generated; {a.rounds} rounds, medians; tokens identical with and "
          f"without the cache in every round")
    print(f"{'prefix cache':<13} {'TTFT ms (client)':>17} {'TTFT ms (gateway)':>18} "
          f"{'reused tokens':>14}")
    med = {}
    for k, label in (("none", "off"), ("cache", "on")):
        v = rows[k]
        med[k] = (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
        print(f"{label:<13} {med[k][0] * 1e3:>17.2f} {med[k][1] * 1e3:>18.2f} "
              f"{statistics.median(x[2] for x in v):>8.0f} of {v[0][3]}")
    print(f"TTFT ratio off/on: client {med['none'][0] / med['cache'][0]:.2f}x, "
          f"gateway {med['none'][1] / med['cache'][1]:.2f}x")


if __name__ == "__main__":
    main()
