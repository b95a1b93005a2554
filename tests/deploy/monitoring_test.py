#!/usr/bin/env python3
"""Monitoring integration test: the real processes, a real Prometheus, the shipped dashboard and
alert rules.

Starts two worker pairs (gpu-worker on the CPU + cpu-worker, each pair with its own temporary
shared-memory segment) and a gateway over both, all on port 0, then a Prometheus server (Debian's
`prometheus`) on a free loopback port that scrapes the five processes every second with the job
names of deploy/prometheus/prometheus.yml and loads deploy/prometheus/alerts.yml. While greedy
Generate streams (and some invalid requests) run through the gateway, it checks through
Prometheus' HTTP API that:

- every target is up;
- every expression of the Grafana dashboard (deploy/grafana/dashboards/pinfer.json) returns at
  least one finite value;
- every alert and recording rule has been evaluated without error, and every metric it selects
  has series (so no rule is silently evaluating over nothing);
- the gateway spread the requests over both worker pairs (each gpu-worker sampled tokens);
and, outside Prometheus, that the streamed tokens equal transformers' greedy tokens from
reference.json, that pinfer-health-probe sees the gateway SERVING and that its --drain mode
drains a gpu-worker.

usage: monitoring_test.py BIN_DIR   (BIN_DIR holds pinfer-gateway, pinfer-gpu-worker,
                                      pinfer-cpu-worker, pinfer-health-probe)
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

import grpc
import yaml

import pinfer_testlib as lib

BIN = None
RATE_WINDOW = "15s"   # $__rate_interval for 1 s scrapes: well over four samples
MAX_NEW_TOKENS = 12


class MonitoringTest(unittest.TestCase):
    procs = []

    @classmethod
    def start(cls, name, args):
        log = open(cls.tmp / f"{name}.log", "w")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        cls.procs.append((name, p, log))
        return p

    @classmethod
    def read_port(cls, name):
        path = cls.tmp / name

        def port():
            p = path.read_text().strip() if path.exists() else ""
            return int(p) if p else 0
        for pname, p, _ in cls.procs:
            if p.poll() is not None:
                raise AssertionError(f"{pname} exited with {p.returncode}: "
                                     + (cls.tmp / f"{pname}.log").read_text()[-2000:])
        return lib.wait_for(port, 60, f"port file {name}")

    @classmethod
    def setUpClass(cls):
        for tool in ("pinfer-gateway", "pinfer-gpu-worker", "pinfer-cpu-worker",
                     "pinfer-health-probe"):
            if not (BIN / tool).exists():
                raise AssertionError(f"{BIN / tool} is missing: build it first")
        cls.prometheus_bin = shutil.which("prometheus")
        if cls.prometheus_bin is None:
            raise AssertionError("prometheus not found: install Debian's `prometheus` package")
        cls.tmp = pathlib.Path(tempfile.mkdtemp(prefix="pinfer-monitoring-"))
        cls.pb2, cls.pb2_grpc = lib.load_stubs(cls.tmp)
        model = str(lib.MODELS / "relu-llama-tiny")
        tag = f"{os.getpid()}-{int(time.time() * 1000) % 100000}"

        # Two worker pairs.
        cls.pairs = []
        for i in range(2):
            segment = f"/pinfer-mon-{tag}-{i}"
            cls.start(f"gpu-worker-{i}", [
                str(BIN / "pinfer-gpu-worker"), "--model", model, "--backend", "cpu",
                "--listen", "127.0.0.1:0", "--port-file", str(cls.tmp / f"gpu{i}.port"),
                "--metrics-port", "127.0.0.1:0",
                "--metrics-port-file", str(cls.tmp / f"gpu{i}.metrics"),
                "--segment", segment, "--threads", "1"])
            cls.start(f"cpu-worker-{i}", [
                str(BIN / "pinfer-cpu-worker"), "--model", model,
                "--listen", "127.0.0.1:0", "--port-file", str(cls.tmp / f"cpu{i}.port"),
                "--metrics-port", "127.0.0.1:0",
                "--metrics-port-file", str(cls.tmp / f"cpu{i}.metrics"),
                "--segment", segment, "--threads", "1"])
        for i in range(2):
            cls.pairs.append({
                "gpu": cls.read_port(f"gpu{i}.port"), "gpu_metrics": cls.read_port(f"gpu{i}.metrics"),
                "cpu": cls.read_port(f"cpu{i}.port"), "cpu_metrics": cls.read_port(f"cpu{i}.metrics")})
        workers = ",".join(f"127.0.0.1:{p['gpu']}" for p in cls.pairs)
        cls.start("gateway", [
            str(BIN / "pinfer-gateway"), "--workers", workers,
            "--listen", "127.0.0.1:0", "--port-file", str(cls.tmp / "gateway.port"),
            "--metrics-port", "127.0.0.1:0",
            "--metrics-port-file", str(cls.tmp / "gateway.metrics"),
            # At most one stream per pair at a time, so that two concurrent clients must use both.
            "--max-running", "1",
            # The HTTP API too, so that the dashboard's HTTP panels have data.
            "--http-port", "0", "--http-port-file", str(cls.tmp / "gateway.http")])
        cls.gateway = cls.read_port("gateway.port")
        cls.gateway_http = cls.read_port("gateway.http")
        cls.gateway_metrics = cls.read_port("gateway.metrics")

        # Prometheus with the shipped rules and the shipped job names.
        shipped = yaml.safe_load((lib.DEPLOY / "prometheus" / "prometheus.yml").read_text())
        jobs = {j["job_name"] for j in shipped["scrape_configs"]}
        assert {"pinfer-gateway", "pinfer-gpu-worker", "pinfer-cpu-worker"} <= jobs
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(lib.DEPLOY / "prometheus" / "alerts.yml")],
            "scrape_configs": [
                {"job_name": "pinfer-gateway",
                 "static_configs": [{"targets": [f"127.0.0.1:{cls.gateway_metrics}"]}]},
                {"job_name": "pinfer-gpu-worker", "static_configs": [
                    {"targets": [f"127.0.0.1:{p['gpu_metrics']}"], "labels": {"pair": str(i)}}
                    for i, p in enumerate(cls.pairs)]},
                {"job_name": "pinfer-cpu-worker", "static_configs": [
                    {"targets": [f"127.0.0.1:{p['cpu_metrics']}"], "labels": {"pair": str(i)}}
                    for i, p in enumerate(cls.pairs)]},
            ],
        }
        (cls.tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = lib.free_port()
        cls.start("prometheus", [
            cls.prometheus_bin, f"--config.file={cls.tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={cls.tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}"])
        cls.prom = lib.Prometheus(f"http://127.0.0.1:{port}")
        lib.wait_for(cls.prom.ready, 60, "Prometheus to be ready")

        # The gateway is SERVING once a worker pair is ready (checked with the image's probe).
        probe = [str(BIN / "pinfer-health-probe"), "--addr", f"127.0.0.1:{cls.gateway}",
                 "--timeout", "2"]
        lib.wait_for(lambda: subprocess.run(probe, capture_output=True).returncode == 0, 60,
                     "the gateway's health to be SERVING")

        # Load: two client threads of greedy streams, and an invalid request now and then.
        cls.channel = grpc.insecure_channel(f"127.0.0.1:{cls.gateway}")
        cls.stub = cls.pb2_grpc.InferenceStub(cls.channel)
        cls.stop = threading.Event()
        cls.results, cls.errors = [], []
        cls.invalid_codes = []
        prompts = lib.reference_prompts()

        def client(k):
            n = 0
            while not cls.stop.is_set():
                prompt, ref = prompts[(k + 2 * n) % len(prompts)]
                n += 1
                try:
                    ids, finish, usage = lib.generate(cls.stub, cls.pb2, prompt, MAX_NEW_TOKENS)
                    cls.results.append((prompt, ids, ref[:MAX_NEW_TOKENS], finish, usage))
                except grpc.RpcError as e:
                    cls.errors.append((prompt, e.code(), e.details()))
                if n % 4 == 0:
                    try:
                        lib.generate(cls.stub, cls.pb2, "", MAX_NEW_TOKENS)
                        cls.invalid_codes.append(grpc.StatusCode.OK)
                    except grpc.RpcError as e:
                        cls.invalid_codes.append(e.code())
                    # One OpenAI-style completion over HTTP (same queue, so it counts above too).
                    body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
                    try:
                        urllib.request.urlopen(urllib.request.Request(
                            f"http://127.0.0.1:{cls.gateway_http}/v1/completions", data=body,
                            headers={"Content-Type": "application/json"}), timeout=60).read()
                    except OSError as e:
                        cls.errors.append((prompt, "http", str(e)))

        cls.threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(2)]
        for t in cls.threads:
            t.start()
        # Long enough that every rate window holds load and every rule has been evaluated.
        lib.wait_for(lambda: len(cls.results) >= 8, 120, "8 completed Generate calls")
        time.sleep(8)

    @classmethod
    def tearDownClass(cls):
        if hasattr(cls, "stop"):
            cls.stop.set()
            for t in cls.threads:
                t.join(timeout=60)
        for name, p, log in reversed(cls.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p, log in reversed(cls.procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()
        if os.environ.get("PINFER_KEEP_TMP"):
            print(f"kept {cls.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_a_streams_are_correct(self):
        self.assertEqual(self.errors, [])
        self.assertGreaterEqual(len(self.results), 8)
        for prompt, ids, ref, finish, usage in self.results:
            self.assertEqual(ids, ref, f"greedy tokens for {prompt!r}")
            self.assertEqual(finish, self.pb2.FINISH_REASON_LENGTH)
            self.assertEqual(usage.generated_tokens, MAX_NEW_TOKENS)
        self.assertTrue(self.invalid_codes)
        self.assertEqual(set(self.invalid_codes), {grpc.StatusCode.INVALID_ARGUMENT})

    def test_targets_up(self):
        targets = self.prom.targets()
        by_job = {}
        for t in targets:
            by_job.setdefault(t["labels"]["job"], []).append(t)
            self.assertEqual(t["health"], "up", f"{t['scrapeUrl']}: {t['lastError']}")
        self.assertEqual({j: len(ts) for j, ts in by_job.items()},
                         {"pinfer-gateway": 1, "pinfer-gpu-worker": 2, "pinfer-cpu-worker": 2})

    def test_dashboard_expressions_return_data(self):
        exprs = lib.dashboard_expressions(RATE_WINDOW)
        self.assertGreater(len(exprs), 20)
        empty = []
        for title, legend, expr in exprs:
            if not lib.finite_values(self.prom.query(expr)):
                empty.append(f"{title} [{legend}]: {expr}")
        self.assertEqual(empty, [], "dashboard queries without data")

    def test_alert_rules_evaluate_over_existing_series(self):
        shipped = lib.alert_rules()
        loaded = {r["name"]: r for r in self.prom.rules()}
        for rule in shipped:
            name = rule.get("alert") or rule.get("record")
            self.assertIn(name, loaded, f"rule {name} not loaded")
            r = loaded[name]
            self.assertEqual(r["health"], "ok", f"{name}: {r.get('lastError')}")
            self.assertFalse(r.get("lastError"), name)
            self.assertFalse(r["lastEvaluation"].startswith("0001-"), f"{name} never evaluated")
            for metric in lib.metric_names(rule["expr"]):
                self.assertTrue(self.prom.query(f"count({metric})"),
                                f"{name} selects {metric}, which has no series")
        # Recording rules produce data from the live series.
        for rule in shipped:
            if "record" in rule:
                self.assertTrue(self.prom.query(rule["record"]), f"{rule['record']} is empty")

    def test_gateway_balances_over_both_pairs(self):
        result = self.prom.query('pinfer_worker_tokens_total{job="pinfer-gpu-worker"}')
        tokens = {s["metric"]["pair"]: float(s["value"][1]) for s in result}
        self.assertEqual(set(tokens), {"0", "1"})
        for pair, n in tokens.items():
            self.assertGreater(n, 0, f"pair {pair} served no tokens: {tokens}")

    def test_workers_serve_grpc_health(self):
        # The container healthchecks and Kubernetes probes ask the workers' health service.
        for p in self.pairs:
            for port in (p["gpu"], p["cpu"]):
                r = subprocess.run([str(BIN / "pinfer-health-probe"), "--addr",
                                    f"127.0.0.1:{port}", "--timeout", "5"],
                                   capture_output=True, text=True)
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_z_drain_probe(self):
        # Last (tests run in name order): stop the load, then drain pair 1.
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)
        r = subprocess.run([str(BIN / "pinfer-health-probe"), "--drain", "--addr",
                            f"127.0.0.1:{self.pairs[1]['gpu']}", "--timeout", "30"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("drained", r.stdout)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    BIN = pathlib.Path(sys.argv.pop(1)).resolve()
    unittest.main(verbosity=2)
