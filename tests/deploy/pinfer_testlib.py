"""Helpers shared by the deployment tests: Python gRPC stubs generated from proto/ at test time,
a greedy Generate client, Prometheus HTTP API queries, and the dashboard/alert expressions the
tests evaluate. Debian's python3-grpcio and python3-grpc-tools provide grpc and the generator.
"""

import importlib
import json
import math
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MODELS = ROOT / "models"


def load_stubs(out_dir):
    """Generates pinfer.v1 Python stubs into out_dir and returns (pb2, pb2_grpc).

    Uses Debian's protoc (3.21, matching python3-protobuf 4.21) with grpc_python_plugin: the
    protoc bundled in Debian's grpc_tools is 3.12, too old for the proto3 `optional` fields."""
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if protoc is None or plugin is None:
        raise AssertionError("protoc and grpc_python_plugin are needed (protobuf-compiler, "
                             "protobuf-compiler-grpc)")
    pathlib.Path(out_dir).mkdir(parents=True, exist_ok=True)
    subprocess.run([protoc, f"-I{ROOT / 'proto'}", f"--python_out={out_dir}",
                    f"--grpc_python_out={out_dir}", f"--plugin=protoc-gen-grpc_python={plugin}",
                    "pinfer/v1/inference.proto"], check=True)
    sys.path.insert(0, str(out_dir))
    return (importlib.import_module("pinfer.v1.inference_pb2"),
            importlib.import_module("pinfer.v1.inference_pb2_grpc"))


def reference_prompts():
    """The prompts of relu-llama-tiny/reference.json with transformers' greedy token ids."""
    ref = json.loads((MODELS / "relu-llama-tiny" / "reference.json").read_text())
    return [(p["prompt"], p["greedy_ids"]) for p in ref["prompts"]]


def generate(stub, pb2, prompt, max_new_tokens, timeout=60):
    """A greedy Generate; returns (token ids, finish reason, usage)."""
    req = pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, ignore_eos=True,
                              sampling=pb2.SamplingParams(temperature=0))
    ids, finish, usage = [], None, None
    for resp in stub.Generate(req, timeout=timeout):
        ids.extend(t.id for t in resp.tokens)
        if resp.finish_reason:
            finish, usage = resp.finish_reason, resp.usage
    return ids, finish, usage


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout, what, interval=0.2):
    """Polls predicate() until it returns a true value, which is returned."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # not up yet
            last_error = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                         + (f" (last error: {last_error})" if last_error else ""))


class Prometheus:
    """The parts of Prometheus' HTTP API the tests use."""

    def __init__(self, base_url):
        self.base = base_url.rstrip("/")

    def get(self, path, **params):
        url = self.base + path
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def ready(self):
        with urllib.request.urlopen(self.base + "/-/ready", timeout=2) as r:
            return r.status == 200

    def query(self, expr):
        return self.get("/api/v1/query", query=expr)["result"]

    def targets(self):
        return self.get("/api/v1/targets")["activeTargets"]

    def rules(self):
        return [r for g in self.get("/api/v1/rules")["groups"] for r in g["rules"]]


def finite_values(result):
    """The finite sample values of an instant-query result."""
    out = []
    for series in result:
        v = float(series["value"][1])
        if not math.isnan(v) and not math.isinf(v):
            out.append(v)
    return out


def dashboard_expressions(rate_interval):
    """(panel title, legend, PromQL) for every query of the Grafana dashboard, with Grafana's
    $__rate_interval replaced by a concrete window."""
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "pinfer.json").read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t.get("legendFormat", ""),
                        t["expr"].replace("$__rate_interval", rate_interval)))
    return out


def alert_rules():
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


_PROMQL_WORDS = {"sum", "by", "rate", "histogram_quantile", "clamp_min", "absent", "or", "and",
                 "on", "ignoring", "group_left", "min", "max", "avg", "count", "scalar", "le",
                 "without", "unless", "bool"}


def metric_names(expr):
    """Metric names a PromQL expression selects (identifiers not inside {...} label matchers
    and not functions/keywords); recording-rule names (with ':') included."""
    stripped = re.sub(r"\{[^}]*\}", "{}", expr)
    stripped = re.sub(r'"[^"]*"', '""', stripped)
    stripped = re.sub(r"\[[^\]]*\]", "[]", stripped)
    stripped = re.sub(r"(?<![A-Za-z0-9_:])\d+(\.\d+)?([eE][+-]?\d+)?", "0", stripped)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", stripped):
        word = m.group(0)
        after = stripped[m.end():m.end() + 1]
        if word in _PROMQL_WORDS or after == "(":
            continue
        # Label lists of by(...)/ignoring(...) are words inside parentheses after a keyword.
        before = stripped[:m.start()].rstrip()
        if re.search(r"(by|ignoring|on|without|group_left)\s*\([^)]*$", before):
            continue
        names.add(word)
    return names
