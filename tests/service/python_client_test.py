#!/usr/bin/env python3
"""The service from a second language: `pinfer serve` driven by a Python client whose stubs are
generated from proto/ at test time (examples/python/pinfer_client.py), on Debian's python3-grpcio.

Checks what the service issue asks users to see: greedy Generate of 48 tokens equals
reference.json's greedy_ids for all 12 prompts of relu-llama-tiny; the three roles run as three
processes; an empty prompt gets INVALID_ARGUMENT; pinfer_generation_tokens_total counts the
tokens; after the cpu-worker is killed a request ends (error or success) well within 30 s and the
service is correct again within a minute (serve restarts it); SIGTERM stops everything and removes
the shared-memory segment.

    python3 tests/service/python_client_test.py --pinfer build/cli/pinfer --model models/relu-llama-tiny
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples", "python"))
import pinfer_client  # noqa: E402

ARGS = None


def wait_for(pred, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
    return out


class ServeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import grpc
        cls.grpc = grpc
        cls.tmp = tempfile.TemporaryDirectory()
        d = cls.tmp.name
        stubs = os.path.join(d, "py")
        os.makedirs(stubs)
        # The health proto's path would make its module `grpc.health.v1`, shadowed by the grpc
        # runtime package; a copy under another path keeps the wire names (package
        # grpc.health.v1) and gets an importable module name.
        extra = os.path.join(d, "protos")
        os.makedirs(os.path.join(extra, "health_check"))
        with open(os.path.join(REPO, "tests/service/protos/grpc/health/v1/health.proto")) as f:
            with open(os.path.join(extra, "health_check", "health.proto"), "w") as g:
                g.write(f.read())
        pinfer_client.generate_stubs(
            stubs, proto_dirs=[os.path.join(REPO, "proto"), extra],
            protos=["pinfer/v1/inference.proto", "health_check/health.proto"])
        from health_check import health_pb2, health_pb2_grpc
        cls.health_pb2, cls.health_grpc = health_pb2, health_pb2_grpc
        cls.files = {k: os.path.join(d, k) for k in ("port", "mport", "status.json", "serve.log")}
        cls.log = open(cls.files["serve.log"], "w")
        cls.serve = subprocess.Popen(
            [ARGS.pinfer, "serve", "--model", ARGS.model, "--host", "127.0.0.1", "--port", "0",
             "--port-file", cls.files["port"], "--metrics-port", "0",
             "--metrics-port-file", cls.files["mport"], "--status-file", cls.files["status.json"]],
            stdout=cls.log, stderr=subprocess.STDOUT)
        port = wait_for(lambda: cls.read_int("port"), 60, "the gateway's port file")
        cls.mport = wait_for(lambda: cls.read_int("mport"), 60, "the metrics port file")
        cls.address = f"127.0.0.1:{port}"
        cls.client = pinfer_client.Client(cls.address)
        cls.health = health_pb2_grpc.HealthStub(cls.client.channel)
        wait_for(lambda: cls.serving(), 60, "health SERVING")
        with open(os.path.join(ARGS.model, "reference.json")) as f:
            cls.ref = json.load(f)

    @classmethod
    def tearDownClass(cls):
        if cls.serve.poll() is None:
            cls.serve.kill()
            cls.serve.wait()
        cls.log.close()
        # ctest shows this only when the test fails.
        with open(cls.files["serve.log"]) as f:
            tail = f.read().splitlines()[-60:]
        print("--- pinfer serve log (tail) ---\n" + "\n".join(tail), file=sys.stderr)
        cls.tmp.cleanup()

    @classmethod
    def read_int(cls, name):
        try:
            with open(cls.files[name]) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    @classmethod
    def status(cls):
        with open(cls.files["status.json"]) as f:
            return json.load(f)

    @classmethod
    def serving(cls):
        try:
            r = cls.health.Check(cls.health_pb2.HealthCheckRequest(service=""), timeout=2)
            return r.status == cls.health_pb2.HealthCheckResponse.SERVING
        except cls.grpc.RpcError:
            return False

    def answers(self):
        """A one-token request succeeds. The gateway's health lags a worker pair that has just
        gone back to waiting for its restarted cpu-worker (which answers UNAVAILABLE until it
        has loaded its rows), so health alone does not say a request will be served."""
        try:
            self.client.generate(prompt="Once", max_new_tokens=1)
            return True
        except self.grpc.RpcError as e:
            if e.code() != self.grpc.StatusCode.UNAVAILABLE:
                raise
            return False

    def greedy_all(self):
        for p in self.ref["prompts"]:
            ids, _, last = self.client.generate(prompt=p["prompt"], max_new_tokens=48,
                                                ignore_eos=True)
            self.assertEqual(ids, p["greedy_ids"], p["prompt"])
            self.assertEqual(last.usage.generated_tokens, 48)

    def test_1_three_processes(self):
        st = self.status()
        exes = {}
        for role in ("gateway", "gpu_worker", "cpu_worker"):
            pid = st[role]
            exes[role] = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        self.assertEqual(exes, {"gateway": "pinfer-gateway", "gpu_worker": "pinfer-gpu-worker",
                                "cpu_worker": "pinfer-cpu-worker"})
        self.assertEqual(len({st["gateway"], st["gpu_worker"], st["cpu_worker"],
                              self.serve.pid}), 4)
        self.assertTrue(os.path.exists("/dev/shm" + st["segment"]))
        self.assertEqual(os.stat("/dev/shm" + st["segment"]).st_mode & 0o777, 0o600)

    def test_2_greedy_matches_reference_and_metrics_count_tokens(self):
        before = scrape(self.mport).get("pinfer_generation_tokens_total", 0)
        self.greedy_all()
        after = scrape(self.mport)
        self.assertEqual(after["pinfer_generation_tokens_total"] - before, 12 * 48)
        self.assertGreaterEqual(after['pinfer_requests_total{finish_reason="length"}'], 12)
        info = self.client.model_info()
        self.assertEqual(info.num_layers, 6)
        self.assertEqual(info.placement.gpu_neurons + info.placement.cpu_neurons, 6 * 1536)

    def test_3_empty_prompt_is_invalid_argument(self):
        with self.assertRaises(self.grpc.RpcError) as e:
            self.client.generate(prompt="", max_new_tokens=8)
        self.assertEqual(e.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("empty", e.exception.details())

    def test_4_killed_cpu_worker_then_recovery(self):
        old = self.status()["cpu_worker"]
        os.kill(old, signal.SIGKILL)
        t0 = time.time()
        try:
            self.client.generate(prompt="The Python interpreter", max_new_tokens=48)
        except self.grpc.RpcError as e:
            self.assertIn(e.code(), (self.grpc.StatusCode.UNAVAILABLE,
                                     self.grpc.StatusCode.DEADLINE_EXCEEDED))
        elapsed = time.time() - t0
        self.assertLess(elapsed, 30, "a request hung after the cpu-worker died")
        # serve restarts the cpu-worker; the service is correct again well within a minute.
        wait_for(lambda: self.status()["cpu_worker"] != old and self.serving() and self.answers(),
                 60, "the restarted cpu-worker")
        self.assertGreaterEqual(self.status()["cpu_worker_restarts"], 1)
        self.greedy_all()

    def test_5_sigterm_stops_everything(self):
        st = self.status()
        self.serve.send_signal(signal.SIGTERM)
        self.assertEqual(self.serve.wait(timeout=40), 0)
        for role in ("gateway", "gpu_worker", "cpu_worker"):
            self.assertFalse(os.path.exists(f"/proc/{st[role]}/exe"), role + " still runs")
        self.assertFalse(os.path.exists("/dev/shm" + st["segment"]))


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--pinfer", required=True)
    ap.add_argument("--model", default=os.path.join(REPO, "models", "relu-llama-tiny"))
    ARGS, rest = ap.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
