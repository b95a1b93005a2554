#!/usr/bin/env python3
"""A Python client for pinfer's public gRPC API (proto/pinfer/v1/inference.proto).

Shows that a second language works from the .proto alone: the stubs are generated at run time
with protoc and grpc_python_plugin (Debian: protobuf-compiler, protobuf-compiler-grpc) into a
temporary folder; the runtime is Debian's python3-grpcio and python3-protobuf. (Debian's
python3-grpc-tools bundles a protoc too old for proto3 `optional` fields, which the API uses for
the sampling seed, so the system protoc generates the messages.)

    python3 examples/python/pinfer_client.py --address localhost:50051 --prompt "Once upon a time"
"""

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate_stubs(out_dir, proto_dirs=None, protos=None):
    """Generates Python stubs for the pinfer protos (and any extra ones) into out_dir and puts
    out_dir on sys.path."""
    proto_dirs = proto_dirs or [os.path.join(REPO, "proto")]
    protos = protos or ["pinfer/v1/inference.proto"]
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if protoc is None or plugin is None:
        raise RuntimeError("protoc and grpc_python_plugin are needed to generate the stubs")
    cmd = [protoc] + ["-I" + d for d in proto_dirs] + [
        "--python_out=" + out_dir, "--grpc_out=" + out_dir,
        "--plugin=protoc-gen-grpc=" + plugin] + protos
    subprocess.run(cmd, check=True)
    if out_dir not in sys.path:
        sys.path.insert(0, out_dir)
    importlib.invalidate_caches()


def load_api():
    """Imports the generated modules (generate_stubs first)."""
    from pinfer.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402
    return inference_pb2, inference_pb2_grpc


class Client:
    """A thin convenience layer over the generated stub."""

    def __init__(self, address, timeout=60.0):
        import grpc
        self.pb, pb_grpc = load_api()
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.timeout = timeout

    def generate(self, prompt=None, token_ids=None, max_new_tokens=0, temperature=0.0,
                 seed=None, stop=(), ignore_eos=False, request_id=""):
        """Streams a Generate call; returns (token ids, text, last response)."""
        sampling = self.pb.SamplingParams(temperature=temperature)
        if seed is not None:
            sampling.seed = seed
        req = self.pb.GenerateRequest(max_new_tokens=max_new_tokens, sampling=sampling,
                                      stop=list(stop), ignore_eos=ignore_eos,
                                      request_id=request_id)
        if token_ids is not None:
            req.token_ids.ids.extend(token_ids)
        else:
            req.prompt = prompt
        ids, text, last = [], [], None
        for resp in self.stub.Generate(req, timeout=self.timeout):
            ids += [t.id for t in resp.tokens]
            text += [t.text for t in resp.tokens]
            last = resp
        return ids, "".join(text), last

    def model_info(self):
        return self.stub.GetModelInfo(self.pb.GetModelInfoRequest(), timeout=self.timeout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", default="localhost:50051")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        generate_stubs(d)
        c = Client(args.address)
        info = c.model_info()
        print(f"model: {info.architecture}, {info.num_layers} layers, context "
              f"{info.context_length}; FFN neurons: {info.placement.gpu_neurons} on the "
              f"gpu-worker ({info.placement.gpu_backend}), {info.placement.cpu_neurons} on the "
              f"cpu-worker", file=sys.stderr)
        ids, text, last = c.generate(prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                                     temperature=args.temperature)
        print(args.prompt + text)
        print(f"[{last.usage.generated_tokens} tokens, finish "
              f"{c.pb.FinishReason.Name(last.finish_reason)}, time to first token "
              f"{last.timings.time_to_first_token_seconds * 1000:.1f} ms, total "
              f"{last.timings.total_seconds * 1000:.1f} ms]", file=sys.stderr)


if __name__ == "__main__":
    main()
