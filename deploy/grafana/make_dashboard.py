#!/usr/bin/env python3
"""Generates deploy/grafana/dashboards/pinfer.json, the Grafana dashboard of a pinfer deployment.

The panels are declared here as (title, unit, [(legend, PromQL)]) rather than edited as raw
Grafana JSON, because the same list is what the monitoring integration test
(tests/deploy/monitoring_test.py) evaluates against a live Prometheus: every expression on the
dashboard must return data from the real processes. The committed JSON is checked to be current
by tests/deploy (run `deploy/grafana/make_dashboard.py` after editing this file).

Usage: make_dashboard.py [--check]   (writes the JSON; with --check only compares)
"""

import json
import pathlib
import sys

OUT = pathlib.Path(__file__).resolve().parent / "dashboards" / "pinfer.json"
DATASOURCE = {"type": "prometheus", "uid": "pinfer-prometheus"}
RATE = "$__rate_interval"  # Grafana's rate window: at least four scrape intervals.
# The gpu-worker counts the (token, neuron) pairs of both sides of the split, so the GPU share is
# taken from it alone (the cpu-worker's own count would count the cold side twice).
GPU_NEURONS = 'pinfer_worker_neurons_computed_total{job="pinfer-gpu-worker"'
GUESS = "pinfer_worker_cold_guess_neurons_total"
LOADED = "pinfer_worker_guessed_neurons_loaded_total"


def ratio(num, den):
    """num / den of two counters' rates, 0 while den has not moved (a stack without the cold
    guess still shows a value rather than NaN)."""
    return f"sum(rate({num}[{RATE}])) / clamp_min(sum(rate({den}[{RATE}])), 1e-9)"



def quantiles(metric, by="le"):
    """p50/p90/p99 of a histogram, aggregated over every instance of the metric."""
    return [(f"p{int(q * 100)}",
             f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket[{RATE}])))")
            for q in (0.5, 0.9, 0.99)]


# (row title, [(panel title, unit, description, [(legend, expr)])]). Units are Grafana unit ids.
ROWS = [
    ("Requests", [
        ("Request rate by finish reason", "reqps",
         "Completed Generate calls per second, by why they stopped (length, eos, stop, cancelled).",
         [("{{finish_reason}}",
           f"sum by (finish_reason) (rate(pinfer_requests_total[{RATE}]))")]),
        ("Errors by code", "reqps",
         "Generate calls that ended with an error status, by gRPC code.",
         [("{{code}}", f"sum by (code) (rate(pinfer_request_failures_total[{RATE}]))")]),
        ("Running and waiting requests", "short",
         "Requests being generated on a worker pair, and requests queued in the gateway.",
         [("running", "sum(pinfer_requests_running)"),
          ("waiting", "sum(pinfer_requests_waiting)")]),
        ("HTTP API requests by route and status", "reqps",
         "Requests to the OpenAI-compatible HTTP API (`--http-port`) per second, by route and HTTP "
         "status code. They run through the same queue as gRPC calls, so they count above too.",
         [("{{path}} {{code}}", f"sum by (path, code) (rate(pinfer_http_requests_total[{RATE}]))")]),
        ("HTTP API request duration", "s",
         "From a request's arrival at the HTTP port to the end of its response (the whole stream).",
         quantiles("pinfer_http_request_duration_seconds")),
        ("Tokens per second", "short",
         "Generated tokens (decode throughput) and prompt tokens (prefill) per second.",
         [("generated", f"sum(rate(pinfer_generation_tokens_total[{RATE}]))"),
          ("prompt", f"sum(rate(pinfer_prompt_tokens_total[{RATE}]))")]),
    ]),
    ("Latency", [
        ("Time to first token", "s",
         "From arrival at the gateway to the first streamed token (includes queueing and prefill).",
         quantiles("pinfer_time_to_first_token_seconds")),
        ("Inter-token latency", "s", "Time between consecutive streamed tokens (decode step).",
         quantiles("pinfer_inter_token_latency_seconds")),
        ("End-to-end request duration", "s", "From arrival at the gateway to the last token.",
         quantiles("pinfer_request_duration_seconds")),
        ("Queue time", "s", "Time a request waits in the gateway before a worker pair takes it.",
         quantiles("pinfer_queue_time_seconds")),
    ]),
    ("Workers", [
        ("Activated neurons served by the GPU", "percentunit",
         "Share of the FFN neurons computed per token that the gpu-worker computed (hot rows); "
         "the rest are the cpu-worker's cold rows. Higher is faster: raise the VRAM budget in "
         "`pinfer prepare` to move more hot rows to the GPU. (The gpu-worker counts both sides.)",
         [("gpu share",
           f"sum(rate({GPU_NEURONS},side=\"gpu\"}}[{RATE}])) / sum(rate({GPU_NEURONS}}}[{RATE}]))")]),
        ("Compute time per layer step", "s",
         "Mean compute time of one layer for one forward step: the gpu-worker's dense work "
         "(attention, norms, head) and hot FFN rows, and the cpu-worker's cold FFN rows.",
         [("gpu-worker {{kind}}",
           "sum by (kind) (rate(pinfer_worker_compute_seconds_total{job=\"pinfer-gpu-worker\"}"
           f"[{RATE}])) / ignoring(kind) group_left "
           f"sum(rate(pinfer_worker_shm_wait_seconds_count{{job=\"pinfer-gpu-worker\"}}[{RATE}]))"),
          ("cpu-worker ffn (cold)",
           f"sum(rate(pinfer_worker_exchange_compute_seconds_sum[{RATE}])) / "
           f"sum(rate(pinfer_worker_exchange_compute_seconds_count[{RATE}]))")]),
        ("Shared-memory wait per layer (gpu-worker)", "s",
         "Time the gpu-worker waits for the cold share of a layer after finishing its hot share. "
         "Near zero means the cpu-worker keeps up; growing waits mean the CPU side is the "
         "bottleneck (move more rows to the GPU or give the cpu-worker more threads).",
         quantiles("pinfer_worker_shm_wait_seconds")),
        ("Busy and waiting time per second", "percentunit",
         "Seconds per second each worker spends computing, by kind, and the cpu-worker's idle "
         "wait for the next exchange.",
         [("{{job}} {{kind}}",
           f"sum by (job, kind) (rate(pinfer_worker_compute_seconds_total[{RATE}]))"),
          ("cpu-worker idle wait",
           f"sum(rate(pinfer_worker_shm_wait_seconds_total[{RATE}]))")]),
        ("Resident memory per process", "bytes",
         "Resident set size of each process and the FFN rows each worker holds; the cpu-worker "
         "maps only the cold rows.",
         [("{{job}} {{instance}} resident", "sum by (job, instance) (pinfer_worker_resident_bytes)"),
          ("gateway {{instance}} resident",
           "sum by (instance) (pinfer_gateway_resident_bytes)"),
          ("{{job}} {{instance}} ffn rows",
           "sum by (job, instance) (pinfer_worker_ffn_row_bytes)")]),
        ("FFN sparsity", "percentunit",
         "Share of (token, neuron) pairs skipped because the activation was zero (exact mode) or "
         "predicted zero (sparse mode), over each worker's lifetime.",
         [("{{job}}", "avg by (job) (pinfer_worker_ffn_sparsity)")]),
        ("Backend and peers", "short",
         "Backend each worker computes on (1 = in use), whether the gpu-worker has a usable GPU, "
         "and whether each worker sees its peer alive.",
         [("{{job}} backend={{backend}}", "max by (job, backend) (pinfer_worker_backend_info)"),
          ("gpu available", "min(pinfer_worker_gpu_available)"),
          ("{{job}} peer alive", "min by (job) (pinfer_worker_peer_alive)")]),
        ("Cold guess: recall and loads ahead", "percentunit",
         "With `--cold-guess` (CUDA gpu-worker) and `--prefetch-guess` (cpu-worker): the share of "
         "the actual cold lists the guesses held (recall), the share of guessed neurons whose rows "
         "the cpu-worker loaded before the layer's request came, and the share of those loads "
         "from the guesses' first tiers. Zero where the guess is off.",
         [("recall", ratio(f'{GUESS}{{kind="held"}}', f'{GUESS}{{kind="actual"}}')),
          ("guessed neurons loaded ahead",
           ratio(f'{LOADED}{{kind="all"}}', f'{GUESS}{{kind="guessed"}}')),
          ("loads from first tiers", ratio(f'{LOADED}{{kind="first"}}', f'{LOADED}{{kind="all"}}'))]),
        ("Cold guess: size", "short",
         "Guessed neurons per actual cold neuron, and first-tier neurons per actual one. A guess "
         "much larger than its list is loaded only in part before the request comes, which is "
         "why its first tier is loaded first.",
         [("guessed / actual", ratio(f'{GUESS}{{kind="guessed"}}', f'{GUESS}{{kind="actual"}}')),
          ("first tier / actual", ratio(f'{GUESS}{{kind="first"}}', f'{GUESS}{{kind="actual"}}'))]),
        ("Prefix cache", "short",
         "Share of new sequences whose prompt began with tokens a kept KV cache held (hit rate), "
         "prompt tokens per second taken from the cache instead of computed, and the kept caches "
         "(a chat's next turn re-sends its history; `--prefix-cache-entries`).",
         [("hit rate",
           ratio('pinfer_worker_prefix_cache_lookups_total{result="hit"}',
                 "pinfer_worker_prefix_cache_lookups_total")),
          ("reused tokens/s",
           f"sum(rate(pinfer_worker_prefix_cache_reused_tokens_total[{RATE}]))"),
          ("kept caches", 'sum(pinfer_worker_prefix_cache_size{unit="entries"})')]),
        ("Targets up", "short", "Scrape health of every pinfer process (1 = up).",
         [("{{job}} {{instance}}", "up{job=~\"pinfer-.*\"}")]),
    ]),
]


def panel(pid, title, unit, description, targets, x, y):
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr,
                     "legendFormat": legend, "range": True}
                    for i, (legend, expr) in enumerate(targets)],
    }


def dashboard():
    panels, pid, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, unit, description, targets) in enumerate(row_panels):
            panels.append(panel(pid, title, unit, description, targets, 12 * (i % 2), y))
            pid += 1
            if i % 2 == 1 or i == len(row_panels) - 1:
                y += 8
    return {
        "uid": "pinfer-overview",
        "title": "pinfer",
        "description": "pinfer service: requests, latency, tokens, and the GPU/CPU neuron split.",
        "tags": ["pinfer"],
        "timezone": "browser",
        "editable": True,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": []},
        "annotations": {"list": []},
        "panels": panels,
    }


def render():
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv):
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run {pathlib.Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
