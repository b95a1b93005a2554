#!/usr/bin/env python3
"""Containerised end-to-end test: builds the images and runs the compose stack for real.

No container registry is reachable from the test machines, so the test makes its base image
itself: debootstrap (Debian 12 minbase from Debian's mirror) into a temporary folder, imported
with `podman import`. The images are built from deploy/docker/*.Dockerfile with that base as
BUILDER_IMAGE and RUNTIME_IMAGE and PINFER_BUILD=prebuilt, copying the binaries of this build
(bundled with their libraries by deploy/docker/bundle.sh) instead of compiling in a container;
Prometheus' image is the same base plus the host's Debian Prometheus binary
(tests/deploy/prometheus.Dockerfile). Then deploy/compose/docker-compose.cpu.yml runs gateway,
gpu-worker (CPU mode), cpu-worker and Prometheus through docker-compose v1 against
`podman system service` (DOCKER_HOST), and the test

- waits for the gateway container's gRPC health check (pinfer-health-probe inside the image);
- sends greedy Generate calls from a Python client through the gateway's published port and
  compares the tokens with transformers' greedy tokens in reference.json (the split across two
  containers sharing IPC must be exact), and an empty prompt (INVALID_ARGUMENT);
- checks that Prometheus (scraping by compose service names) has the three pinfer targets up and
  that the pinfer metrics arrive: generated tokens, cold neurons computed by the cpu-worker
  container, the INVALID_ARGUMENT failure;
- checks the workers' health checks inside their containers;
- stops the gateway with SIGTERM through the stack's init (`init: true`) and expects a clean
  exit (drain, status 0).

Podman runs with runc (crun fails on these machines' cgroup layout), cgroupfs, the ulimits
below, and all its storage, run state and network configuration in the temporary folder, which
is removed at the end; podman uses CNI networks (containernetworking-plugins, with the dnsname
plugin resolving compose service names). Needs root, network access to the Debian mirror, and
these Debian packages: podman runc catatonit debootstrap docker-compose
containernetworking-plugins golang-github-containernetworking-plugin-dnsname iptables prometheus
python3-yaml python3-grpcio protobuf-compiler protobuf-compiler-grpc.

usage: container_e2e_test.py BIN_DIR
env:   PINFER_E2E_BASE_TAR=FILE  reuse (or create) a tarball of the debootstrapped base
       PINFER_DEBIAN_MIRROR=URL  mirror for debootstrap (default http://deb.debian.org/debian)
       PINFER_KEEP_TMP=1         keep the temporary folder (logs) after the test
"""

import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import grpc

import pinfer_testlib as lib

BASE_IMAGE = "localhost/pinfer-e2e-base:bookworm"
IMAGE_PREFIX = "localhost/pinfer-e2e"
COMPOSE_FILE = lib.DEPLOY / "compose" / "docker-compose.cpu.yml"
PACKAGES = {"podman": "podman", "runc": "runc", "debootstrap": "debootstrap",
            "docker-compose": "docker-compose", "prometheus": "prometheus",
            "catatonit": "catatonit"}
MAX_NEW_TOKENS = 48


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Stack:
    def __init__(self, bin_dir):
        self.bin = bin_dir
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="pinfer-e2e-"))
        self.service = None
        self.lock_existed = os.path.exists("/dev/shm/libpod_lock")
        self.host_state = host_network_state()
        conf = self.tmp / "containers.conf"
        conf.write_text(f"""[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
init_path = "{shutil.which('catatonit') or '/usr/bin/catatonit'}"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{self.tmp}/run/events.log"
tmp_dir = "{self.tmp}/tmp"
[network]
network_backend = "cni"
network_config_dir = "{self.tmp}/cni"
""")
        storage = self.tmp / "storage.conf"
        storage.write_text(f"""[storage]
driver = "overlay"
graphroot = "{self.tmp}/storage"
runroot = "{self.tmp}/run"
""")
        for d in ("run", "tmp", "cni"):
            (self.tmp / d).mkdir()
        self.socket = self.tmp / "podman.sock"
        self.env = dict(os.environ)
        self.env.update({
            "CONTAINERS_CONF": str(conf),
            "CONTAINERS_STORAGE_CONF": str(storage),
            "DOCKER_HOST": f"unix://{self.socket}",
            "COMPOSE_PROJECT_NAME": f"pinfere2e{os.getpid()}",
            "PINFER_BUILD": "prebuilt",
            "PINFER_BUILD_CONTEXT": str(self.tmp / "ctx"),
            "PINFER_BUILDER_IMAGE": BASE_IMAGE,
            "PINFER_RUNTIME_IMAGE": BASE_IMAGE,
            "PINFER_IMAGE_PREFIX": IMAGE_PREFIX,
            "PINFER_TAG": "test",
            "PINFER_PROMETHEUS_IMAGE": f"{IMAGE_PREFIX}/prometheus:test",
            "PINFER_MODELS_DIR": str(lib.MODELS),
            "PINFER_MODEL": "relu-llama-tiny",
            "PINFER_PORT": str(lib.free_port()),
            "PINFER_PROMETHEUS_PORT": str(lib.free_port()),
            "PINFER_GRAFANA_PORT": str(lib.free_port()),
            "PINFER_GPU_WORKER_THREADS": "1",
            "PINFER_CPU_WORKER_THREADS": "1",
        })

    def run(self, args, check=True, timeout=600, quiet=False, **kw):
        r = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout,
                           **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, args))} failed ({r.returncode}):\n"
                                 f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return r

    def podman(self, *args, **kw):
        return self.run(["podman", *args], **kw)

    def compose(self, *args, **kw):
        return self.run(["docker-compose", "-f", str(COMPOSE_FILE), *args], **kw)

    # --- set-up ---------------------------------------------------------------------------

    def make_base_image(self):
        cached = os.environ.get("PINFER_E2E_BASE_TAR")
        tar = pathlib.Path(cached) if cached else self.tmp / "base.tar"
        if not tar.exists():
            mirror = os.environ.get("PINFER_DEBIAN_MIRROR", "http://deb.debian.org/debian")
            rootfs = self.tmp / "rootfs"
            log(f"debootstrap bookworm (minbase) from {mirror}")
            self.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), mirror],
                     timeout=900)
            self.run(["tar", "-C", str(rootfs), "-cf", str(tar), "."])
            shutil.rmtree(rootfs)
        log(f"podman import {tar.name}")
        self.podman("import", str(tar), BASE_IMAGE)
        if not cached:
            tar.unlink()

    def make_context(self):
        ctx = self.tmp / "ctx"
        shutil.copytree(lib.DEPLOY / "docker", ctx / "deploy" / "docker")
        files = [self.bin / n for n in ("pinfer-gateway", "pinfer-gpu-worker",
                                        "pinfer-cpu-worker", "pinfer-health-probe",
                                        "libpinfer_spm.so")]
        for f in files:
            if not f.exists():
                raise AssertionError(f"{f} is missing: build the service first")
        self.run([str(lib.DEPLOY / "docker" / "bundle.sh"), str(ctx / "prebuilt"),
                  *map(str, files)])
        prom = self.tmp / "promctx"
        prom.mkdir()
        shutil.copy(shutil.which("prometheus"), prom / "prometheus")

    def start_service(self):
        self.service_log = open(self.tmp / "podman-service.log", "w")
        self.service = subprocess.Popen(
            ["podman", "system", "service", "--time=0", f"unix://{self.socket}"],
            env=self.env, stdout=self.service_log, stderr=subprocess.STDOUT)
        lib.wait_for(lambda: self.socket.exists(), 30, "the podman API socket")

    def build_images(self):
        log("building images (prebuilt binaries)")
        self.compose("build", "gateway", "gpu-worker", "cpu-worker")
        self.podman("build", "--format", "docker", "-f",
                    str(lib.ROOT / "tests" / "deploy" / "prometheus.Dockerfile"),
                    "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
                    "-t", f"{IMAGE_PREFIX}/prometheus:test", str(self.tmp / "promctx"))
        images = self.podman("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
        for name in ("gateway", "gpu-worker", "cpu-worker", "prometheus"):
            assert f"{IMAGE_PREFIX}/{name}:test" in images, images

    # --- tear-down ------------------------------------------------------------------------

    def cleanup(self):
        if self.service is not None and self.socket.exists():
            # `down` against podman sometimes leaves the network behind the first time.
            for _ in range(2):
                self.compose("down", "-v", "--remove-orphans", "-t", "10", check=False,
                             timeout=120)
        if self.service is not None:
            self.service.terminate()
            try:
                self.service.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.service.kill()
                self.service.wait()
            self.service_log.close()
        self.podman("rm", "-a", "-f", "-t", "0", check=False, timeout=120)
        self.podman("system", "reset", "--force", check=False, timeout=300)
        # Anything still mounted under the temporary folder (overlay layers, shm) goes too.
        with open("/proc/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[1].startswith(str(self.tmp))]
        for m in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)
        restore_host_network(self.host_state)
        if not self.lock_existed and os.path.exists("/dev/shm/libpod_lock"):
            os.unlink("/dev/shm/libpod_lock")
        if os.environ.get("PINFER_KEEP_TMP"):
            log(f"kept {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def host_network_state():
    """Bridges and iptables rules, to remove what the CNI plugins leave behind."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    rules = {}
    for table in ("filter", "nat"):
        r = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True)
        rules[table] = set(r.stdout.splitlines())
    return {l.split(":")[1].strip().split("@")[0] for l in links.splitlines()}, rules


def restore_host_network(before):
    """Deletes CNI bridges and CNI rules that appeared during the test (the network plugins
    leave a DNS rule and the bridge behind even after the network is removed)."""
    links, rules = host_network_state()
    for link in links - before[0]:
        if link.startswith("cni-"):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
    for table, now in rules.items():
        for rule in now - before[1][table]:
            if rule.startswith("-A ") and "cni-" in rule.lower():
                subprocess.run(["iptables", "-t", table, "-D", *shlex.split(rule)[1:]],
                               capture_output=True)


def container_id(stack, service):
    out = stack.compose("ps", "-q", service).stdout.split()
    assert out, f"no container for {service}"
    return out[0]


def check(stack):
    env = stack.env
    log("docker-compose up: gateway, gpu-worker, cpu-worker, prometheus")
    stack.compose("up", "-d", "--no-build", "gateway", "gpu-worker", "cpu-worker", "prometheus")
    gateway = container_id(stack, "gateway")

    def gateway_serving():
        return stack.podman("exec", gateway, "pinfer-health-probe", "--addr", "127.0.0.1:50051",
                            "--timeout", "2", check=False).returncode == 0
    try:
        lib.wait_for(gateway_serving, 120, "the gateway container's health check", interval=1)
    except AssertionError:
        print(stack.compose("logs", "--tail", "40", check=False).stdout)
        raise
    log("gateway SERVING")

    # A client outside the containers, through the published port.
    pb2, pb2_grpc = lib.load_stubs(stack.tmp / "py")
    channel = grpc.insecure_channel(f"127.0.0.1:{env['PINFER_PORT']}")
    stub = pb2_grpc.InferenceStub(channel)
    prompts = lib.reference_prompts()[:2]
    for prompt, ref in prompts:
        ids, finish, usage = lib.generate(stub, pb2, prompt, MAX_NEW_TOKENS, timeout=120)
        assert ids == ref[:MAX_NEW_TOKENS], f"{prompt!r}: {ids} != {ref[:MAX_NEW_TOKENS]}"
        assert finish == pb2.FINISH_REASON_LENGTH and usage.generated_tokens == MAX_NEW_TOKENS
    try:
        lib.generate(stub, pb2, "", 4)
        raise AssertionError("an empty prompt was accepted")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
    channel.close()
    log(f"{len(prompts)} greedy generations equal reference.json; empty prompt rejected")

    prom = lib.Prometheus(f"http://127.0.0.1:{env['PINFER_PROMETHEUS_PORT']}")

    def targets_up():
        up = {t["labels"]["job"] for t in prom.targets() if t["health"] == "up"}
        return {"pinfer-gateway", "pinfer-gpu-worker", "pinfer-cpu-worker"} <= up
    lib.wait_for(targets_up, 90, "Prometheus targets of the three pinfer containers up",
                 interval=1)
    log("Prometheus targets up")
    want = {
        "sum(pinfer_generation_tokens_total)": len(prompts) * MAX_NEW_TOKENS,
        'sum(pinfer_requests_total{finish_reason="length"})': len(prompts),
        'sum(pinfer_request_failures_total{code="INVALID_ARGUMENT"})': 1,
        # The cpu-worker container computed cold neurons: the shared IPC namespace works.
        'sum(pinfer_worker_neurons_computed_total{job="pinfer-cpu-worker"})': 1,
        'sum(pinfer_worker_neurons_computed_total{job="pinfer-gpu-worker",side="gpu"})': 1,
    }

    def metrics_arrived():
        return all(sum(lib.finite_values(prom.query(q))) >= v for q, v in want.items())
    try:
        lib.wait_for(metrics_arrived, 60, "pinfer metrics in Prometheus", interval=1)
    except AssertionError:
        print({q: prom.query(q) for q in want})
        raise
    log("pinfer metrics arrived in Prometheus")

    for service, port in (("gpu-worker", 50052), ("cpu-worker", 50053)):
        r = stack.podman("exec", container_id(stack, service), "pinfer-health-probe", "--addr",
                         f"127.0.0.1:{port}", "--timeout", "5", check=False)
        assert r.returncode == 0, f"{service} health check: {r.stdout}{r.stderr}"
    log("worker health checks pass")

    # SIGTERM through the init process: the gateway drains and exits 0.
    stack.compose("stop", "-t", "30", "gateway")
    code = stack.podman("inspect", "--format", "{{.State.ExitCode}}", gateway).stdout.strip()
    assert code == "0", f"gateway exited with {code} on SIGTERM"
    log("gateway stopped cleanly on SIGTERM")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    bin_dir = pathlib.Path(sys.argv[1]).resolve()
    if os.geteuid() != 0:
        sys.exit("container_e2e_test: needs root (podman with runc, debootstrap)")
    missing = [pkg for tool, pkg in PACKAGES.items() if shutil.which(tool) is None]
    if missing:
        sys.exit(f"container_e2e_test: missing tools; apt-get install {' '.join(missing)}")
    start = time.monotonic()
    stack = Stack(bin_dir)
    try:
        stack.make_base_image()
        stack.make_context()
        stack.start_service()
        stack.build_images()
        check(stack)
    finally:
        try:
            stack.cleanup()
        except Exception as e:  # never mask the test's own failure
            print(f"cleanup: {e}", file=sys.stderr)
    log(f"PASS in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
