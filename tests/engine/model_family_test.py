#!/usr/bin/python3
"""Checks pinfer on Llama-family models it has never seen, against an independent NumPy forward.

Builds small random Hugging Face models that differ in every way the family allows (grouped-query
ratios, head_dim not equal to hidden/heads, tied embeddings, RoPE theta given at the top level or
inside rope_parameters, Llama-3 rope scaling, SiLU/ReLU/dReLU, F32/F16/BF16 weights, sharded
safetensors, vocabulary sizes), runs `pinfer generate --json --logits`, and compares the last prompt
logits and the greedy tokens with a plain float64 NumPy implementation written from the
transformers definition of LlamaForCausalLM.

Mistral cases (MistralForCausalLM: Llama's network with a sliding window) use a window shorter than
the prompt, check that the NumPy reference with the window differs from the one without (so the
window is really exercised), compare pinfer with the windowed reference, and do the same for the
GGUF that `pinfer convert` writes from the directory.

usage: model_family_test.py PINFER_BINARY TOKENIZER_MODEL
"""
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

PROMPT = "The quick brown fox jumps over the lazy dog"
NEW_TOKENS = 8


def bf16_bytes(a):
    u = a.astype(np.float32).view(np.uint32)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return u.tobytes(), u.view(np.uint16)


def to_stored(a, dtype):
    """Returns (bytes, the values the file actually holds as float64)."""
    if dtype == "F32":
        x = a.astype(np.float32)
        return x.tobytes(), x.astype(np.float64)
    if dtype == "F16":
        x = a.astype(np.float16)
        return x.tobytes(), x.astype(np.float64)
    raw, u = bf16_bytes(a)
    return raw, (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def write_safetensors(path, tensors, dtype):
    header, blobs, offset, stored = {}, [], 0, {}
    for name, a in tensors.items():
        raw, vals = to_stored(a, dtype)
        stored[name] = vals
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return stored


def make_model(d, cfg, dtype, shards, seed):
    rng = np.random.default_rng(seed)
    H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t = {"model.embed_tokens.weight": rng.normal(0, 1, (V, H)),
         "model.norm.weight": rng.uniform(0.5, 1.5, H)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = rng.normal(0, 1 / math.sqrt(H), (V, H))
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        t[p + "input_layernorm.weight"] = rng.uniform(0.5, 1.5, H)
        t[p + "post_attention_layernorm.weight"] = rng.uniform(0.5, 1.5, H)
        t[p + "self_attn.q_proj.weight"] = rng.normal(0, 1 / math.sqrt(H), (nh * hd, H))
        t[p + "self_attn.k_proj.weight"] = rng.normal(0, 1 / math.sqrt(H), (nkv * hd, H))
        t[p + "self_attn.v_proj.weight"] = rng.normal(0, 1 / math.sqrt(H), (nkv * hd, H))
        t[p + "self_attn.o_proj.weight"] = rng.normal(0, 1 / math.sqrt(nh * hd), (H, nh * hd))
        t[p + "mlp.gate_proj.weight"] = rng.normal(0, 1 / math.sqrt(H), (F, H))
        t[p + "mlp.up_proj.weight"] = rng.normal(0, 1 / math.sqrt(H), (F, H))
        t[p + "mlp.down_proj.weight"] = rng.normal(0, 1 / math.sqrt(F), (H, F))
    names = list(t)
    stored = {}
    if shards == 1:
        stored.update(write_safetensors(os.path.join(d, "model.safetensors"), t, dtype))
    else:
        weight_map = {}
        per = math.ceil(len(names) / shards)
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: t[n] for n in names[s * per:(s + 1) * per]}
            stored.update(write_safetensors(os.path.join(d, fname), part, dtype))
            weight_map.update({n: fname for n in part})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return stored


def inv_freq(cfg):
    hd = cfg["head_dim"]
    rp = cfg.get("rope_parameters", {})
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    sc = cfg.get("rope_scaling") or (rp if rp.get("rope_type") == "llama3" else None)
    if sc and sc.get("rope_type", sc.get("type")) == "llama3":
        f, lo, hi, old = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"], sc["original_max_position_embeddings"]
        wl = 2 * math.pi / inv
        out = np.where(wl > old / lo, inv / f, inv)
        smooth = (old / wl - lo) / (hi - lo)
        mid = (wl <= old / lo) & (wl >= old / hi)
        out = np.where(mid, (1 - smooth) * inv / f + smooth * inv, out)
        inv = out
    return inv


def forward(w, cfg, ids):
    """Plain transformers-style Llama forward in float64; returns logits [T, V]."""
    H, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, T = cfg["rms_norm_eps"], len(ids)
    act = cfg["hidden_act"]
    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g
    def rope(x):  # x: [T, heads, hd], rotate-half
        ang = np.arange(T)[:, None] * inv_freq(cfg)[None, :]
        cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
        sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
        rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + rot * sin
    x = w["model.embed_tokens.weight"][ids]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        s = s + np.triu(np.full((T, T), -np.inf), 1)[None]
        window = cfg.get("sliding_window") if cfg.get("model_type") == "mistral" else None
        if window is not None and window < cfg["max_position_embeddings"]:
            # transformers' Mistral mask keeps key j for query p only when j > p - sliding_window.
            s = s + np.tril(np.full((T, T), -np.inf), -window)[None]
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(T, nh * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        g, u = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        if act == "silu":
            a = g / (1 + np.exp(-g)) * u
        elif act == "relu":
            a = np.maximum(g, 0) * u
        else:
            a = np.maximum(g, 0) * np.maximum(u, 0)
        x = x + a @ w[p + "mlp.down_proj.weight"].T
    x = norm(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


MISTRAL = dict(architectures=["MistralForCausalLM"], model_type="mistral")

CASES = [
    # name, config overrides, dtype, shards
    ("gqa4_silu_llama3_rope", dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
      hidden_act="silu", rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
      high_freq_factor=4.0, original_max_position_embeddings=16), vocab_size=4100), "F32", 1),
    ("tied_relu_mha_bf16", dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, head_dim=16,
      hidden_act="relu", tie_word_embeddings=True, rope_theta=10000.0, vocab_size=4096), "BF16", 1),
    ("drelu_headdim_sharded_f16", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
      hidden_act="drelu", rope_parameters=dict(rope_theta=1000.0, rope_type="default"), vocab_size=4200), "F16", 3),
    ("mistral_window4_gqa_silu", dict(MISTRAL, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
      head_dim=8, hidden_act="silu", rope_theta=10000.0, sliding_window=4, vocab_size=4096), "F32", 1),
    ("mistral_window8_bf16", dict(MISTRAL, hidden_size=48, num_attention_heads=4, num_key_value_heads=4,
      head_dim=12, hidden_act="silu", rope_theta=1000000.0, sliding_window=8, vocab_size=4096), "BF16", 1),
]


def greedy_ids(w, cfg, ids, n):
    seq, out = list(ids), []
    for _ in range(n):
        nxt = int(np.argmax(forward(w, cfg, seq)[-1]))
        out.append(nxt)
        seq.append(nxt)
    return out


def check(name, pinfer, model, w, cfg, window_check=True):
    """Runs pinfer on `model` (a directory or a GGUF) against the reference; returns True if equal.
    With a sliding window (and window_check), also that the window changes the reference."""
    out = subprocess.run([pinfer, "generate", "--model", model, "--prompt", PROMPT, "--max-tokens", str(NEW_TOKENS),
                          "--json", "--logits"], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"FAIL {name}: pinfer exited {out.returncode}: {out.stderr}")
        return False
    got = json.loads(out.stdout)
    ids = got["prompt_ids"]
    want_last = forward(w, cfg, ids)[-1]
    err = np.abs(np.array(got["last_prompt_logits"]) - want_last).max() / np.abs(want_last).max()
    greedy = greedy_ids(w, cfg, ids, NEW_TOKENS)
    ok = err <= 1e-4 and greedy == got["generated_ids"]
    verdict = "equal" if greedy == got["generated_ids"] else f"{got['generated_ids']} != {greedy}"
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max logit error {err:.2e} (relative to max |logit|), "
          f"greedy {verdict}")
    if ok and window_check and cfg.get("sliding_window"):
        # The window must matter for this prompt: without it the reference differs clearly.
        if len(ids) + NEW_TOKENS <= cfg["sliding_window"]:
            print(f"FAIL {name}: the window {cfg['sliding_window']} covers all {len(ids) + NEW_TOKENS} positions")
            return False
        plain = {k: v for k, v in cfg.items() if k != "sliding_window"}
        full_last = forward(w, plain, ids)[-1]
        diff = np.abs(full_last - want_last).max() / np.abs(want_last).max()
        full_greedy = greedy_ids(w, plain, ids, NEW_TOKENS)
        if diff < 0.05 and full_greedy == greedy:
            print(f"FAIL {name}: the window changes the reference too little (logits {diff:.2e}, same greedy)")
            return False
        print(f"ok   {name}: without the window the reference's last logits differ by {diff:.2e} and its greedy "
              f"tokens {'differ' if full_greedy != greedy else 'agree'}")
    return ok


def main():
    pinfer, spm = sys.argv[1], sys.argv[2]
    failures, checks = 0, 0
    for i, (name, over, dtype, shards) in enumerate(CASES):
        cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=96,
                   num_hidden_layers=2, rms_norm_eps=1e-5, max_position_embeddings=256, bos_token_id=1,
                   eos_token_id=2, tie_word_embeddings=False)
        cfg.update(over)
        d = tempfile.mkdtemp(prefix="pinfer-family-")
        try:
            w = make_model(d, cfg, dtype, shards, seed=100 + i)
            shutil.copy(spm, os.path.join(d, "tokenizer.model"))
            checks += 1
            failures += 0 if check(name, pinfer, d, w, cfg) else 1
            if cfg.get("sliding_window"):
                # The GGUF that `pinfer convert` writes carries the window (llama.attention.sliding_window).
                gguf = os.path.join(d, "model.gguf")
                conv = subprocess.run([pinfer, "convert", "--model", d, "--out", gguf, "--type", "f32"],
                                      capture_output=True, text=True)
                checks += 1
                if conv.returncode != 0:
                    print(f"FAIL {name} gguf: pinfer convert exited {conv.returncode}: {conv.stderr}")
                    failures += 1
                else:
                    failures += 0 if check(name + " gguf", pinfer, gguf, w, cfg, window_check=False) else 1
        finally:
            shutil.rmtree(d)
    print(f"{checks - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
