#!/usr/bin/env python3
"""Generates docs/api.md, the API reference, from the comments in proto/.

The .proto files are the single source of truth for the API: their comments are the
documentation. protoc compiles them into a descriptor set with source info (which keeps each
element's leading comment), and this script renders services, messages and enums as Markdown. A
test (tests/deploy, `api_doc_current`) runs it with --check so the committed api.md never drifts
from the protos.

Usage: gen_api.py [--check] [--protoc PATH]
"""

import argparse
import pathlib
import subprocess
import sys
import tempfile

from google.protobuf import descriptor_pb2

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT = ROOT / "docs" / "api.md"
# Public API first, then the internal worker protocol.
FILES = ["pinfer/v1/inference.proto", "pinfer/worker/v1/worker.proto"]

FD = descriptor_pb2.FieldDescriptorProto
SCALARS = {
    FD.TYPE_DOUBLE: "double", FD.TYPE_FLOAT: "float", FD.TYPE_INT64: "int64",
    FD.TYPE_UINT64: "uint64", FD.TYPE_INT32: "int32", FD.TYPE_FIXED64: "fixed64",
    FD.TYPE_FIXED32: "fixed32", FD.TYPE_BOOL: "bool", FD.TYPE_STRING: "string",
    FD.TYPE_BYTES: "bytes", FD.TYPE_UINT32: "uint32", FD.TYPE_SFIXED32: "sfixed32",
    FD.TYPE_SFIXED64: "sfixed64", FD.TYPE_SINT32: "sint32", FD.TYPE_SINT64: "sint64",
}
# Paths into FileDescriptorProto (descriptor.proto field numbers) for source locations.
MESSAGE, ENUM, SERVICE = 4, 5, 6
MSG_FIELD, MSG_NESTED, MSG_ENUM, MSG_ONEOF = 2, 3, 4, 8
ENUM_VALUE, SERVICE_METHOD = 2, 2


def compile_descriptors(protoc):
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "api.desc"
        subprocess.run([protoc, f"--proto_path={PROTO_DIR}", "--include_source_info",
                        f"--descriptor_set_out={out}", *FILES], check=True)
        fds = descriptor_pb2.FileDescriptorSet()
        fds.ParseFromString(out.read_bytes())
        return fds


def clean(comment):
    """A comment as one Markdown paragraph (table cells cannot hold line breaks)."""
    lines = [line.strip() for line in comment.strip().splitlines()]
    return " ".join(line for line in lines if line).replace("|", "\\|")


def paragraphs(comment):
    """A file or element comment as Markdown paragraphs (blank comment lines separate them)."""
    out, cur = [], []
    for line in comment.strip().splitlines():
        line = line.strip()
        if line:
            cur.append(line)
        elif cur:
            out.append(" ".join(cur))
            cur = []
    if cur:
        out.append(" ".join(cur))
    return out


def type_name(field):
    if field.type in (FD.TYPE_MESSAGE, FD.TYPE_ENUM):
        name = field.type_name.lstrip(".")
        return f"[`{name}`](#{anchor(name)})"
    return f"`{SCALARS[field.type]}`"


def anchor(full_name):
    return full_name.lower().replace(".", "")


def render_file(fd):
    comments = {tuple(loc.path): loc.leading_comments for loc in fd.source_code_info.location}
    # The file's opening comment is attached to the `syntax` statement (path [12]).
    header = comments.get((12,), "") or comments.get((2,), "")
    pkg = fd.package
    out = [f"## Package `{pkg}` ({fd.name})", ""]
    for para in paragraphs(header):
        out += [para, ""]

    for si, svc in enumerate(fd.service):
        full = f"{pkg}.{svc.name}"
        out += [f"### service {svc.name}", f'<a id="{anchor(full)}"></a>', ""]
        doc = clean(comments.get((SERVICE, si), ""))
        if doc:
            out += [doc, ""]
        out += ["| method | request | response | description |", "|---|---|---|---|"]
        for mi, m in enumerate(svc.method):
            req = m.input_type.lstrip(".")
            resp = m.output_type.lstrip(".")
            req_s = ("stream " if m.client_streaming else "") + f"[`{req}`](#{anchor(req)})"
            resp_s = ("stream " if m.server_streaming else "") + f"[`{resp}`](#{anchor(resp)})"
            desc = clean(comments.get((SERVICE, si, SERVICE_METHOD, mi), ""))
            out.append(f"| `{m.name}` | {req_s} | {resp_s} | {desc} |")
        out.append("")

    def render_enum(enum, path, prefix):
        full = f"{prefix}.{enum.name}"
        lines = [f"### enum {full[len(pkg) + 1:]}", f'<a id="{anchor(full)}"></a>', ""]
        doc = clean(comments.get(path, ""))
        if doc:
            lines += [doc, ""]
        lines += ["| value | number | description |", "|---|---|---|"]
        for vi, v in enumerate(enum.value):
            desc = clean(comments.get(path + (ENUM_VALUE, vi), ""))
            lines.append(f"| `{v.name}` | {v.number} | {desc} |")
        return lines + [""]

    def render_message(msg, path, prefix):
        full = f"{prefix}.{msg.name}"
        lines = [f"### message {full[len(pkg) + 1:]}", f'<a id="{anchor(full)}"></a>', ""]
        doc = clean(comments.get(path, ""))
        if doc:
            lines += [doc, ""]
        if msg.field:
            lines += ["| field | type | number | description |", "|---|---|---|---|"]
            for fi, f in enumerate(msg.field):
                label = ""
                if f.label == FD.LABEL_REPEATED:
                    label = "repeated "
                elif f.proto3_optional:
                    label = "optional "
                typ = label + type_name(f)
                desc = clean(comments.get(path + (MSG_FIELD, fi), ""))
                if f.HasField("oneof_index") and not f.proto3_optional:
                    oneof = msg.oneof_decl[f.oneof_index].name
                    desc = f"(oneof `{oneof}`) {desc}".strip()
                lines.append(f"| `{f.name}` | {typ} | {f.number} | {desc} |")
        else:
            lines.append("No fields.")
        lines.append("")
        for ni, nested in enumerate(msg.nested_type):
            lines += render_message(nested, path + (MSG_NESTED, ni), full)
        for ei, e in enumerate(msg.enum_type):
            lines += render_enum(e, path + (MSG_ENUM, ei), full)
        return lines

    for mi, msg in enumerate(fd.message_type):
        out += render_message(msg, (MESSAGE, mi), pkg)
    for ei, e in enumerate(fd.enum_type):
        out += render_enum(e, (ENUM, ei), pkg)
    return out


def render(protoc):
    fds = compile_descriptors(protoc)
    by_name = {fd.name: fd for fd in fds.file}
    out = [
        "# pinfer API reference",
        "",
        "<!-- Generated by docs/gen_api.py from the comments in proto/; do not edit by hand. -->",
        "",
        "The gateway serves the public API, `pinfer.v1.Inference`, on its gRPC port (50051 in the "
        "container images), together with the standard `grpc.health.v1.Health` service and "
        "server reflection (so `grpcurl` works without the .proto files). `pinfer.worker.v1` is "
        "the internal protocol between the gateway and the workers; it is documented for "
        "operators and is not a stable contract.",
        "",
        "Example with grpcurl:",
        "",
        "```sh",
        "grpcurl -plaintext -d '{\"prompt\": \"Once upon a time\", \"max_new_tokens\": 32}' \\",
        "  localhost:50051 pinfer.v1.Inference/Generate",
        "```",
        "",
    ]
    for name in FILES:
        out += render_file(by_name[name])
    return "\n".join(out).rstrip() + "\n"


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="fail if docs/api.md is not current")
    ap.add_argument("--protoc", default="protoc")
    args = ap.parse_args(argv)
    text = render(args.protoc)
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
