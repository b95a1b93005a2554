#!/usr/bin/env python3
"""Structural checks of the deployment files in deploy/ and of the generated docs.

These files are not run by the other tests except through the containerised end-to-end test
(which uses only the CPU compose file), so what matters about the rest is checked here: the
compose stacks have the five services with a GPU reservation and shared IPC, the Kubernetes
manifests have Deployments and Services for the gateway and the worker pairs with in-memory
/dev/shm, GPU requests, gRPC probes and a preStop drain, the Dockerfiles are multi-stage,
non-root, with base images as build arguments, the Prometheus configuration and rules pass
promtool, and the generated dashboard and API reference are current.

Run: python3 tests/deploy/config_structure_test.py   (needs python3-yaml and promtool)
"""

import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
JOBS = {"pinfer-gateway", "pinfer-gpu-worker", "pinfer-cpu-worker"}
PORTS = {"gateway": (50051, 9400), "gpu-worker": (50052, 9401), "cpu-worker": (50053, 9402)}


def load_yaml(path):
    with open(path) as f:
        return yaml.safe_load(f)


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def flag_value(args, flag):
    """The value after `flag` in an argument list, or None."""
    args = [str(a) for a in args]
    return args[args.index(flag) + 1] if flag in args else None


def promtool():
    tool = shutil.which("promtool")
    if tool is None:
        raise AssertionError("promtool not found: install Debian's `prometheus` package")
    return tool


class ComposeTest(unittest.TestCase):
    def check_common(self, path):
        doc = load_yaml(path)
        services = doc["services"]
        self.assertEqual(set(services),
                         {"gateway", "gpu-worker", "cpu-worker", "prometheus", "grafana"}, path)
        for name in ("gateway", "gpu-worker", "cpu-worker"):
            svc = services[name]
            grpc_port, metrics_port = PORTS[name]
            self.assertIs(svc.get("init"), True, f"{name}: PID 1 must forward SIGTERM")
            self.assertEqual(svc["build"]["dockerfile"], f"deploy/docker/{name}.Dockerfile")
            for arg in ("BUILDER_IMAGE", "RUNTIME_IMAGE", "PINFER_BUILD"):
                self.assertIn(arg, svc["build"]["args"], f"{name} build args")
            self.assertEqual(flag_value(svc["command"], "--listen"), f"0.0.0.0:{grpc_port}")
            self.assertEqual(flag_value(svc["command"], "--metrics-port"), str(metrics_port))
            test = svc["healthcheck"]["test"]
            self.assertEqual(test[:2], ["CMD", "pinfer-health-probe"], f"{name} healthcheck")
            self.assertEqual(flag_value(test, "--addr"), f"127.0.0.1:{grpc_port}")
        gpu, cpu = services["gpu-worker"], services["cpu-worker"]
        # The workers exchange activations through the gpu-worker's /dev/shm.
        self.assertEqual(gpu["ipc"], "shareable")
        self.assertEqual(cpu["ipc"], "service:gpu-worker")
        self.assertEqual(flag_value(gpu["command"], "--segment"),
                         flag_value(cpu["command"], "--segment"))
        for svc in (gpu, cpu):
            self.assertTrue(any(str(v).endswith(":/models:ro") for v in svc["volumes"]),
                            "the model volume is mounted read-only at /models")
        # The gateway routes to this pair.
        self.assertEqual(flag_value(services["gateway"]["command"], "--workers"), "gpu-worker:50052")
        prom = services["prometheus"]
        mounts = " ".join(prom["volumes"])
        self.assertIn("../prometheus/prometheus.yml:/etc/prometheus/prometheus.yml", mounts)
        self.assertIn("../prometheus/alerts.yml:/etc/prometheus/alerts.yml", mounts)
        self.assertIn("--config.file=/etc/prometheus/prometheus.yml", prom["command"])
        graf = " ".join(services["grafana"]["volumes"])
        self.assertIn("../grafana/provisioning:/etc/grafana/provisioning", graf)
        self.assertIn("../grafana/dashboards:/var/lib/grafana/dashboards", graf)
        for v in list(services["prometheus"]["volumes"]) + list(services["grafana"]["volumes"]):
            src = str(v).split(":")[0]
            if src.startswith("."):
                self.assertTrue((path.parent / src).exists(), f"{path}: {src} does not exist")
        return services

    def test_gpu_stack(self):
        services = self.check_common(DEPLOY / "compose" / "docker-compose.yml")
        gpu = services["gpu-worker"]
        devices = gpu["deploy"]["resources"]["reservations"]["devices"]
        self.assertEqual(devices, [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}])
        self.assertEqual(gpu["build"]["args"]["PINFER_CUDA"], "1")
        self.assertIn("nvidia/cuda", gpu["build"]["args"]["RUNTIME_IMAGE"])
        for name in ("gateway", "cpu-worker"):
            self.assertNotIn("deploy", services[name])

    def test_cpu_stack(self):
        services = self.check_common(DEPLOY / "compose" / "docker-compose.cpu.yml")
        gpu = services["gpu-worker"]
        self.assertNotIn("deploy", gpu, "no GPU reservation in the CPU-only stack")
        self.assertEqual(gpu["build"]["args"]["PINFER_CUDA"], "0")
        self.assertNotIn("nvidia", gpu["build"]["args"]["RUNTIME_IMAGE"])
        self.assertEqual(flag_value(gpu["command"], "--backend"), "cpu")

    def test_variants_differ_only_in_gpu_worker(self):
        a = load_yaml(DEPLOY / "compose" / "docker-compose.yml")["services"]
        b = load_yaml(DEPLOY / "compose" / "docker-compose.cpu.yml")["services"]
        for name in ("gateway", "cpu-worker", "prometheus", "grafana"):
            self.assertEqual(a[name], b[name], f"{name} differs between the compose variants")

    def test_docker_compose_accepts_them(self):
        tool = shutil.which("docker-compose")
        if tool is None:
            self.skipTest("docker-compose not installed (the container test needs it)")
        for f in ("docker-compose.yml", "docker-compose.cpu.yml"):
            r = subprocess.run([tool, "-f", f, "config", "-q"], cwd=DEPLOY / "compose",
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, f"{f}: {r.stderr}")


class KubernetesTest(unittest.TestCase):
    def setUp(self):
        self.objects = {}
        for path in sorted((DEPLOY / "k8s").rglob("*.yaml")):
            for doc in load_all(path):
                self.assertIn("apiVersion", doc, path)
                self.assertIn("kind", doc, path)
                if doc["kind"] == "Kustomization":
                    continue
                self.assertIn("name", doc["metadata"], path)
                self.objects[(doc["kind"], doc["metadata"]["name"])] = (path, doc)

    def get(self, kind, name):
        self.assertIn((kind, name), self.objects, f"missing {kind}/{name}")
        return self.objects[(kind, name)][1]

    def test_kustomization_lists_every_file(self):
        k = load_yaml(DEPLOY / "k8s" / "kustomization.yaml")
        for r in k["resources"]:
            self.assertTrue((DEPLOY / "k8s" / r).exists(), r)
        self.assertIn("worker-pair.yaml", k["resources"])
        self.assertIn("gateway.yaml", k["resources"])

    def test_selectors_match_pod_labels(self):
        for (kind, name), (_, doc) in self.objects.items():
            if kind == "Deployment":
                labels = doc["spec"]["template"]["metadata"]["labels"]
                for k, v in doc["spec"]["selector"]["matchLabels"].items():
                    self.assertEqual(labels.get(k), v, f"{name} selector")
            if kind == "Service":
                pods = [d for (k2, _), (_, d) in self.objects.items() if k2 == "Deployment" and
                        all(d["spec"]["template"]["metadata"]["labels"].get(k) == v
                            for k, v in doc["spec"]["selector"].items())]
                self.assertTrue(pods, f"Service {name} selects no Deployment")
                ports = {p["name"]: p["containerPort"] for d in pods
                         for c in d["spec"]["template"]["spec"]["containers"]
                         for p in c.get("ports", [])}
                for p in doc["spec"]["ports"]:
                    target = p.get("targetPort", p["port"])
                    if isinstance(target, str):
                        self.assertIn(target, ports, f"Service {name}: no container port {target}")

    def worker_pairs(self):
        return sorted(name for (kind, name) in self.objects
                      if kind == "Deployment" and name.startswith("pinfer-worker-pair-"))

    def test_worker_pairs(self):
        pairs = self.worker_pairs()
        self.assertGreaterEqual(len(pairs), 2, "scale-out: several worker pairs")
        first = None
        for name in pairs:
            dep = self.get("Deployment", name)
            self.assertEqual(dep["spec"]["replicas"], 1, f"{name}: one Pod per pair")
            pod = dep["spec"]["template"]["spec"]
            self.assertTrue(pod["securityContext"]["runAsNonRoot"])
            dshm = [v for v in pod["volumes"] if v["name"] == "dshm"][0]
            self.assertEqual(dshm["emptyDir"]["medium"], "Memory")
            containers = {c["name"]: c for c in pod["containers"]}
            self.assertEqual(set(containers), {"gpu-worker", "cpu-worker"})
            for cname, c in containers.items():
                grpc_port = PORTS[cname][0]
                mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                self.assertEqual(mounts.get("/dev/shm"), "dshm", f"{cname} shares /dev/shm")
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    self.assertEqual(c[probe]["grpc"]["port"], grpc_port, f"{cname} {probe}")
                pre = c["lifecycle"]["preStop"]["exec"]["command"]
                self.assertEqual(pre[:2], ["pinfer-health-probe", "--drain"], f"{cname} preStop")
                self.assertEqual(flag_value(pre, "--addr"), "127.0.0.1:50052")
                self.assertEqual(flag_value(c["args"], "--listen"), f"0.0.0.0:{grpc_port}")
            gpu = containers["gpu-worker"]
            self.assertEqual(str(gpu["resources"]["limits"]["nvidia.com/gpu"]), "1")
            self.assertEqual(str(gpu["resources"]["requests"]["nvidia.com/gpu"]), "1")
            self.assertNotIn("nvidia.com/gpu", containers["cpu-worker"]["resources"]["limits"])
            self.assertEqual(flag_value(gpu["args"], "--segment"),
                             flag_value(containers["cpu-worker"]["args"], "--segment"))
            # The preStop drain must fit in the grace period.
            timeout = float(flag_value(gpu["lifecycle"]["preStop"]["exec"]["command"],
                                       "--timeout"))
            self.assertLess(timeout, pod["terminationGracePeriodSeconds"])
            svc = self.get("Service", name)
            self.assertIn(50052, [p["port"] for p in svc["spec"]["ports"]])
            # Pairs differ only in their names.
            text = yaml.safe_dump(dep).replace(name, "PAIR")
            first = first or text
            self.assertEqual(text, first, f"{name} differs from {pairs[0]}")

    def test_gateway(self):
        dep = self.get("Deployment", "pinfer-gateway")
        pod = dep["spec"]["template"]["spec"]
        self.assertTrue(pod["securityContext"]["runAsNonRoot"])
        c = pod["containers"][0]
        self.assertEqual(c["readinessProbe"]["grpc"]["port"], 50051)
        self.assertIn("preStop", c["lifecycle"])
        workers = flag_value(c["args"], "--workers").split(",")
        self.assertEqual(workers, [f"{p}:50052" for p in self.worker_pairs()],
                         "the gateway balances over every worker pair")
        svc = self.get("Service", "pinfer-gateway")
        self.assertIn(50051, [p["port"] for p in svc["spec"]["ports"]])


class DockerfileTest(unittest.TestCase):
    def test_dockerfiles(self):
        for name, (grpc_port, metrics_port) in PORTS.items():
            text = (DEPLOY / "docker" / f"{name}.Dockerfile").read_text()
            lines = [l for l in text.splitlines() if l and not l.startswith("#")]
            froms = [l for l in lines if l.startswith("FROM ")]
            self.assertEqual(len(froms), 2, f"{name}: a build and a runtime stage")
            self.assertEqual(froms[0], "FROM ${BUILDER_IMAGE} AS build")
            self.assertEqual(froms[1], "FROM ${RUNTIME_IMAGE}")
            self.assertRegex(text, r"(?m)^ARG BUILDER_IMAGE=debian:bookworm$")
            runtime = re.search(r"(?m)^ARG RUNTIME_IMAGE=(\S+)$", text).group(1)
            if name == "gpu-worker":
                self.assertTrue(runtime.startswith("nvidia/cuda:") and "runtime" in runtime)
            else:
                self.assertEqual(runtime, "debian:bookworm-slim")
            self.assertRegex(text, r"(?m)^USER 10001:10001$", f"{name} runs as non-root")
            self.assertIn(f'"127.0.0.1:{grpc_port}"', text, f"{name} healthcheck port")
            self.assertRegex(text, rf"(?m)^EXPOSE {grpc_port} {metrics_port}$")
            self.assertIn(f'ENTRYPOINT ["pinfer-{name}"]', text)

    def test_build_scripts_are_posix_sh(self):
        for script in ("build.sh", "bundle.sh"):
            path = DEPLOY / "docker" / script
            r = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertTrue(path.stat().st_mode & 0o111, f"{script} is executable")


class PrometheusTest(unittest.TestCase):
    def test_rules_pass_promtool(self):
        r = subprocess.run([promtool(), "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_rules_cover_the_issue(self):
        rules = [r for g in load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"]
                 for r in g["rules"]]
        exprs = {r["alert"]: r["expr"] for r in rules if "alert" in r}
        joined = " ".join(exprs.values())
        for needle in ("up{", "pinfer_request_failures_total", "pinfer_requests_waiting",
                       "pinfer_time_to_first_token_seconds", "pinfer_inter_token_latency_seconds"):
            self.assertIn(needle, joined)
        for r in rules:
            if "alert" in r:
                self.assertIn(r["labels"]["severity"], {"critical", "warning", "info"})
                self.assertIn("summary", r["annotations"])

    def test_compose_config_passes_promtool(self):
        # The compose config names the rules by their in-container path; point it at the file.
        cfg = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
        self.assertEqual({j["job_name"] for j in cfg["scrape_configs"]} & JOBS, JOBS)
        cfg["rule_files"] = [str(DEPLOY / "prometheus" / "alerts.yml")]
        with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
            yaml.safe_dump(cfg, f)
            f.flush()
            r = subprocess.run([promtool(), "check", "config", f.name], capture_output=True,
                               text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_kubernetes_scrape_config(self):
        cfg = load_yaml(DEPLOY / "k8s" / "monitoring" / "prometheus-scrape.yml")
        job = cfg["scrape_configs"][0]
        self.assertEqual(job["kubernetes_sd_configs"][0]["role"], "pod")
        # Job names must come out as the dashboard and alerts expect: pinfer-<container>.
        relabel = {r.get("target_label"): r for r in job["relabel_configs"]}
        self.assertEqual(relabel["job"]["replacement"], "pinfer-$1")
        self.assertEqual(relabel["job"]["source_labels"], ["__meta_kubernetes_pod_container_name"])
        kept = [r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"]
        self.assertIn("gateway|gpu-worker|cpu-worker", kept)
        # Debian's Prometheus is built without Kubernetes discovery, so promtool checks the
        # relabelling with a static target in its place.
        del job["kubernetes_sd_configs"]
        job["static_configs"] = [{"targets": ["localhost:9400"]}]
        cfg["rule_files"] = [str(DEPLOY / "prometheus" / "alerts.yml")]
        with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
            yaml.safe_dump(cfg, f)
            f.flush()
            r = subprocess.run([promtool(), "check", "config", f.name], capture_output=True,
                               text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


class GeneratedFilesTest(unittest.TestCase):
    def test_dashboard_current_and_wired(self):
        r = subprocess.run([sys.executable, str(DEPLOY / "grafana" / "make_dashboard.py"),
                            "--check"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        dash = json.loads((DEPLOY / "grafana" / "dashboards" / "pinfer.json").read_text())
        ds = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
        uid = ds["datasources"][0]["uid"]
        titles = []
        for p in dash["panels"]:
            if p["type"] == "row":
                continue
            titles.append(p["title"])
            self.assertEqual(p["datasource"]["uid"], uid, p["title"])
            self.assertTrue(p["targets"], p["title"])
        for needed in ("Request rate", "Errors by code", "Time to first token",
                       "Inter-token latency", "End-to-end", "Tokens per second",
                       "Running and waiting", "served by the GPU", "per layer",
                       "Shared-memory wait", "Resident memory", "Cold guess: recall",
                       "Cold guess: size"):
            self.assertTrue(any(needed in t for t in titles), f"no panel for {needed}")
        ids = [p["id"] for p in dash["panels"]]
        self.assertEqual(len(ids), len(set(ids)), "panel ids are unique")

    def test_api_reference_current(self):
        r = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_api.py"), "--check"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        text = (ROOT / "docs" / "api.md").read_text()
        for needle in ("service Inference", "`Generate`", "message GenerateRequest",
                       "enum FinishReason", "service GpuWorker"):
            self.assertIn(needle, text)


if __name__ == "__main__":
    unittest.main(verbosity=2)
