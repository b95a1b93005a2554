#!/usr/bin/python3
"""`pinfer convert --type q4_k_m|q4_k_s|q5_k_m|q5_k_s|q6_k` against llama.cpp's own `quantize`.

llama.cpp is the library node-llama-cpp ships (bench/llama_cpp installs it): its
llama_model_quantize, called here through ctypes without an importance matrix, is what
`llama-quantize F32.gguf OUT.gguf Q4_K_M` runs. For random-weight SiLU Llamas (hidden 512 with
8 layers, so that the mixes' layer rules all show; hidden 384, whose rows are not whole
256-value super-blocks, so that llama.cpp's fallback types show; a BF16 checkpoint) pinfer converts the Hugging Face
directory to F32 and to each mix, llama.cpp quantizes pinfer's F32 file to the same mix, and
  - every tensor must have the same type and the same bytes in both files (llama.cpp's per-tensor
    type choices and ggml's reference quantizers, block for block);
  - a GGUF-to-GGUF `pinfer convert` of the F32 file must give the same bytes too;
  - llama.cpp (node-llama-cpp, CPU, one thread) and `pinfer generate` decode the same 32 greedy
    tokens from pinfer's hidden-512 Q6_K file. For the Q4_K_M and Q5_K_M files the number of
    equal greedy tokens is printed, not asserted: on random models like these, llama.cpp's own
    CPU backends disagree with each other (its AMX kernels and its AVX-512 ones, on the same
    file, diverge after 3 to 12 tokens for Q4_K_M on four seeds of five), and pinfer's tokens
    follow one or the other as often as they follow each other (docs/model-formats.md). A single
    Q4_K / Q6_K row dot of ggml's (ggml_vec_dot_q*_K_q8_K, through ctypes) equals the Q8_K
    formula pinfer computes.
Exits 77 (skipped) when node-llama-cpp is not installed.

usage: llama_cpp_kquant_test.py PINFER_BINARY SOURCE_DIR
"""
import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

PINFER, SOURCE = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
NODE_MODULES = os.path.join(SOURCE, "bench", "llama_cpp", "node_modules")
LIBS = os.path.join(NODE_MODULES, "@node-llama-cpp", "linux-x64", "bins", "linux-x64")
PROMPT = "The quick brown fox jumps over the lazy dog"
# llama_ftype values of llama.h.
MIXES = {"q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18}
# ggml type id -> (name, block elements, block bytes), for the types these files hold.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
              13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}


def to_bf16_bytes(vals):
    """float32 -> bfloat16 (round to nearest even), little-endian bytes."""
    u = np.ascontiguousarray(vals, dtype="<f4").view("<u4")
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()


def random_llama(out, hidden, ffn, layers, heads, kv_heads, seed, layer_gain=1.0, dtype="F16",
                 config=None, qwen2=False, embed_std=1.0, out_norm=1.0, bias_std=0.5, vocab=4096):
    """A random SiLU Llama in F16 (or BF16) safetensors with relu-llama-tiny's tokenizer; with
    `qwen2`, a Qwen2ForCausalLM instead: q/k/v biases and the output head tied to the embeddings."""
    rng = np.random.default_rng(seed)
    V, hd = vocab, hidden // heads
    shapes = {"model.embed_tokens.weight": (V, hidden), "model.norm.weight": (hidden,)}
    if not qwen2:
        shapes["lm_head.weight"] = (V, hidden)
    for l in range(layers):
        p = "model.layers.%d." % l
        if qwen2:
            shapes.update({p + "self_attn.q_proj.bias": (heads * hd,),
                           p + "self_attn.k_proj.bias": (kv_heads * hd,),
                           p + "self_attn.v_proj.bias": (kv_heads * hd,)})
        shapes.update({p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (heads * hd, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * hd),
                       p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                       p + "mlp.down_proj.weight": (hidden, ffn)})
    header, blobs, off = {}, [], 0
    for name, shape in shapes.items():
        if name.endswith(".bias"):
            vals = rng.normal(0, bias_std, shape)
        elif name == "model.norm.weight":
            vals = out_norm * (1.0 + rng.normal(0, 0.1, shape))
        elif len(shape) == 1:
            vals = 1.0 + rng.normal(0, 0.1, shape)
        elif "embed" in name:
            vals = rng.normal(0, embed_std, shape)
        elif "lm_head" in name:
            vals = rng.normal(0, 0.5, shape)  # logits far apart: greedy choices are not near-ties
        else:
            vals = rng.normal(0, layer_gain / np.sqrt(shape[1]), shape)
        raw = vals.astype("<f2").tobytes() if dtype == "F16" else to_bf16_bytes(vals)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    os.makedirs(out)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    tiny = os.path.join(SOURCE, "models", "relu-llama-tiny")
    with open(os.path.join(tiny, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_act="silu", hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd)
    if qwen2:
        cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True,
                   use_sliding_window=False)
        cfg.pop("attention_bias", None)
        cfg.pop("mlp_bias", None)
    cfg.update(config or {})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    shutil.copy(os.path.join(tiny, "tokenizer.model"), out)


def gguf_metadata(path):
    """{key: value} of a GGUF v3 file's metadata (arrays as lists)."""
    return _read_gguf(path)[0]


def gguf_tensors(path):
    """{name: (ggml type, raw bytes)} of a GGUF v3 file."""
    return _read_gguf(path)[1]


def _read_gguf(path):
    with open(path, "rb") as f:
        data = f.read()
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal pos
        n = take("Q")
        s = data[pos:pos + n].decode()
        pos += n
        return s

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("I"), take("Q")
            return [value(et) for _ in range(n)]
        return take(scalar[t])

    assert data[:4] == b"GGUF", path
    pos = 4
    take("I")
    n_tensors, n_kv = take("Q"), take("Q")
    alignment = 32
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("I"))
        if key == "general.alignment":
            alignment = meta[key]
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, dims, take("I"), take("Q")))
    base = (pos + alignment - 1) // alignment * alignment
    out = {}
    for name, dims, t, offset in infos:
        _, block, size = GGML_TYPES[t]
        n = int(np.prod(dims))
        out[name] = (t, data[base + offset:base + offset + n // block * size])
    return meta, out


_quiet = None


def llama_quantize(src, dst, ftype):
    """llama.cpp's llama_model_quantize(src, dst, {ftype, defaults otherwise})."""
    for lib in ("libggml-base.so", "libggml.v0.4.0.so"):
        ctypes.CDLL(os.path.join(LIBS, lib), mode=ctypes.RTLD_GLOBAL)
    llama = ctypes.CDLL(os.path.join(LIBS, "libllama.v0.4.0.so"))

    class Params(ctypes.Structure):
        # llama_model_quantize_params starts {int32 nthread; int32 ftype; ...}; the buffer is larger
        # than the struct, and both are returned in memory, so the call's ABI is the same.
        _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int32), ("rest", ctypes.c_uint8 * 248)]

    llama.llama_model_quantize_default_params.restype = Params
    llama.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(Params)]
    llama.llama_model_quantize.restype = ctypes.c_uint32
    llama.llama_backend_init()
    global _quiet  # kept alive: llama.cpp calls it for every line it logs
    _quiet = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *a: None)
    llama.llama_log_set(_quiet, None)
    p = llama.llama_model_quantize_default_params()
    p.nthread, p.ftype = 1, ftype
    rc = llama.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
    if rc != 0:
        sys.exit("FAILED: llama_model_quantize(%s) returned %d" % (src, rc))


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit("FAILED: %s\n%s" % (" ".join(cmd), r.stderr))
    return r.stdout


def compare(label, ours, theirs):
    """True if both files hold the same tensors with the same types and bytes; prints the rest."""
    a, b = gguf_tensors(ours), gguf_tensors(theirs)
    if sorted(a) != sorted(b):
        print("FAIL %s: tensor names differ: %s" % (label, sorted(set(a) ^ set(b))))
        return False
    bad = []
    for name in sorted(a):
        (ta, da), (tb, db) = a[name], b[name]
        if ta != tb:
            bad.append("%s is %s, llama.cpp %s" % (name, GGML_TYPES[ta][0], GGML_TYPES[tb][0]))
        elif da != db:
            block = GGML_TYPES[ta][2]
            diff = sum(da[i:i + block] != db[i:i + block] for i in range(0, len(da), block))
            bad.append("%s (%s): %d of %d blocks differ" % (name, GGML_TYPES[ta][0], diff, len(da) // block))
    types = {}
    for t, _ in a.values():
        types[GGML_TYPES[t][0]] = types.get(GGML_TYPES[t][0], 0) + 1
    print("%-4s %s: %d tensors (%s) %s" % ("ok" if not bad else "FAIL", label, len(a),
                                          ", ".join("%d %s" % (n, t) for t, n in sorted(types.items())),
                                          "equal to llama.cpp's in type and bytes" if not bad else ""))
    for line in bad[:12]:
        print("  " + line)
    return not bad


def main():
    if not os.path.isfile(os.path.join(NODE_MODULES, "node-llama-cpp", "package.json")) or \
            shutil.which("node") is None:
        print("node-llama-cpp is not installed (bench/llama_cpp): skipped")
        return 77
    tmp = tempfile.mkdtemp(prefix="pinfer-kquant-")
    failed = False
    try:
        script = os.path.join(tmp, "llama_cpp_greedy.mjs")
        shutil.copy(os.path.join(SOURCE, "tests", "model", "llama_cpp_greedy.mjs"), script)
        os.symlink(NODE_MODULES, os.path.join(tmp, "node_modules"))
        # layer_gain 0.5: the layers add to the embedding rather than swamp it, as in trained models.
        models = [("h512", dict(hidden=512, ffn=1024, layers=8, heads=8, kv_heads=4, seed=1,
                                layer_gain=0.5), True),
                  ("h384", dict(hidden=384, ffn=768, layers=2, heads=6, kv_heads=2, seed=2), False),
                  # BF16, the dtype most Hugging Face checkpoints ship.
                  ("h256-bf16", dict(hidden=256, ffn=512, layers=2, heads=4, kv_heads=2, seed=3,
                                     dtype="BF16"), False)]
        for label, shape, greedy in models:
            hf = os.path.join(tmp, label)
            random_llama(hf, **shape)
            f32 = os.path.join(tmp, label + "-f32.gguf")
            run([PINFER, "convert", "--model", hf, "--out", f32, "--type", "f32"])
            for mix, ftype in MIXES.items():
                ours = os.path.join(tmp, "%s-%s.gguf" % (label, mix))
                theirs = os.path.join(tmp, "%s-%s-llama.gguf" % (label, mix))
                requant = os.path.join(tmp, "%s-%s-from-f32.gguf" % (label, mix))
                run([PINFER, "convert", "--model", hf, "--out", ours, "--type", mix])
                run([PINFER, "convert", "--model", f32, "--out", requant, "--type", mix])
                llama_quantize(f32, theirs, ftype)
                failed |= not compare("%s %s" % (label, mix), ours, theirs)
                failed |= not compare("%s %s from the F32 GGUF" % (label, mix), requant, theirs)
                if greedy and mix in ("q4_k_m", "q5_k_m", "q6_k"):
                    n = 32
                    ref = json.loads(run(["node", script, ours, PROMPT, str(n)]).strip().splitlines()[-1])
                    got = json.loads(run([PINFER, "generate", "--model", ours, "--prompt", PROMPT,
                                          "--max-tokens", str(n), "--json"]))
                    same = sum(1 for x, y in zip(ref["generated_ids"], got["generated_ids"]) if x == y)
                    ok = ref["prompt_ids"] == got["prompt_ids"] and ref["generated_ids"] == got["generated_ids"]
                    checked = mix == "q6_k"
                    print("%-4s %s %s: llama.cpp and pinfer greedy tokens, %d of %d equal%s" % (
                        ("ok" if ok else "FAIL") if checked else "info", label, mix, same, n,
                        "" if checked else " (not asserted)"))
                    if not ok and checked:
                        print("  llama.cpp:", ref)
                        print("  pinfer:   ", {k: got[k] for k in ("prompt_ids", "generated_ids")})
                        failed = True
        return 1 if failed else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
