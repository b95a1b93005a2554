#!/usr/bin/python3
"""Writes the fuzzers' seed corpora (tests/fuzz/corpus/): small valid inputs of each format that
reach deep into the parsers, so that mutations start from files that load.

usage: make_seeds.py [CORPUS_DIR]
"""
import json
import os
import random
import struct
import sys

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus")


def gguf(kvs, tensors, magic=b"GGUF", alignment=32):
    """kvs: [(key, type, value)]; tensors: [(name, ggml_type, ne (innermost first), bytes)]."""
    def s(x):
        x = x.encode() if isinstance(x, str) else x
        return struct.pack("<Q", len(x)) + x

    fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(t, v):
        if t == 8:
            return s(v)
        if t == 9:
            et, items = v
            return struct.pack("<IQ", et, len(items)) + b"".join(value(et, i) for i in items)
        return struct.pack("<" + fmt[t], v)

    out = magic + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for k, t, v in kvs:
        out += s(k) + struct.pack("<I", t) + value(t, v)
    offset, data = 0, b""
    for name, typ, ne, raw in tensors:
        out += s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        out += struct.pack("<IQ", typ, offset)
        pad = (-len(raw)) % alignment
        data += raw + b"\0" * pad
        offset += len(raw) + pad
    out += b"\0" * ((-len(out)) % alignment)
    return out + data


def f32(n, rng):
    return struct.pack("<%df" % n, *[rng.gauss(0, 0.2) for _ in range(n)])


def f16(n, rng):
    return struct.pack("<%de" % n, *[rng.gauss(0, 0.2) for _ in range(n)])


def q8_0(n, rng):
    out = b""
    for _ in range(n // 32):
        out += struct.pack("<e", 0.01) + bytes(rng.randrange(256) for _ in range(32))
    return out


def q4_0(n, rng):
    out = b""
    for _ in range(n // 32):
        out += struct.pack("<e", 0.02) + bytes(rng.randrange(256) for _ in range(16))
    return out


def q4_k(n, rng):  # ggml's block_q4_K: d, dmin, 12 bytes of scales, 128 of nibbles
    return b"".join(struct.pack("<ee", 0.01, 0.002) + bytes(rng.randrange(256) for _ in range(140))
                    for _ in range(n // 256))


def q5_k(n, rng):  # block_q5_K: d, dmin, scales[12], qh[32], qs[128]
    return b"".join(struct.pack("<ee", 0.01, 0.002) + bytes(rng.randrange(256) for _ in range(172))
                    for _ in range(n // 256))


def q6_k(n, rng):  # block_q6_K: ql[128], qh[64], scales[16], d
    return b"".join(bytes(rng.randrange(256) for _ in range(208)) + struct.pack("<e", 0.003)
                    for _ in range(n // 256))


def tiny_qwen2_kquant(rng, vocab_kvs, n_vocab):
    """A qwen2 model (q/k/v biases) whose matrices are Q4_K / Q5_K / Q6_K, as a K mix stores them."""
    H, F, heads, kv = 256, 256, 4, 2
    hd = H // heads
    kvs = [("general.architecture", 8, "qwen2"), ("general.name", 8, "seed"),
           ("general.file_type", 4, 15), ("qwen2.context_length", 4, 64),
           ("qwen2.embedding_length", 4, H), ("qwen2.block_count", 4, 1),
           ("qwen2.feed_forward_length", 4, F), ("qwen2.attention.head_count", 4, heads),
           ("qwen2.attention.head_count_kv", 4, kv),
           ("qwen2.attention.layer_norm_rms_epsilon", 6, 1e-6), ("qwen2.rope.freq_base", 6, 1e6)]
    kvs += vocab_kvs
    p = "blk.0."
    t = [("token_embd.weight", 12, [H, n_vocab], q4_k(H * n_vocab, rng)),
         ("output_norm.weight", 0, [H], f32(H, rng)),
         (p + "attn_norm.weight", 0, [H], f32(H, rng)),
         (p + "attn_q.weight", 12, [H, heads * hd], q4_k(H * heads * hd, rng)),
         (p + "attn_q.bias", 0, [heads * hd], f32(heads * hd, rng)),
         (p + "attn_k.weight", 13, [H, kv * hd], q5_k(H * kv * hd, rng)),
         (p + "attn_k.bias", 0, [kv * hd], f32(kv * hd, rng)),
         (p + "attn_v.weight", 14, [H, kv * hd], q6_k(H * kv * hd, rng)),
         (p + "attn_v.bias", 0, [kv * hd], f32(kv * hd, rng)),
         (p + "attn_output.weight", 12, [heads * hd, H], q4_k(H * heads * hd, rng)),
         (p + "ffn_norm.weight", 0, [H], f32(H, rng)),
         (p + "ffn_gate.weight", 12, [H, F], q4_k(H * F, rng)),
         (p + "ffn_up.weight", 13, [H, F], q5_k(H * F, rng)),
         (p + "ffn_down.weight", 14, [F, H], q6_k(F * H, rng))]
    return gguf(kvs, t)


def tiny_llama(rng, vocab_kvs, n_vocab, activation="silu", magic=b"GGUF"):
    H, F, heads, kv, L = 32, 32, 4, 2, 1
    hd = H // heads
    kvs = [("general.architecture", 8, "llama"), ("general.name", 8, "seed"),
           ("llama.context_length", 4, 64), ("llama.embedding_length", 4, H),
           ("llama.block_count", 4, L), ("llama.feed_forward_length", 4, F),
           ("llama.attention.head_count", 4, heads), ("llama.attention.head_count_kv", 4, kv),
           ("llama.attention.layer_norm_rms_epsilon", 6, 1e-5), ("llama.rope.freq_base", 6, 10000.0),
           ("pinfer.hidden_act", 8, activation)] + vocab_kvs
    t = [("token_embd.weight", 8, [H, n_vocab], q8_0(H * n_vocab, rng)),
         ("output_norm.weight", 0, [H], f32(H, rng))]
    for l in range(L):
        p = "blk.%d." % l
        t += [(p + "attn_norm.weight", 0, [H], f32(H, rng)),
              (p + "attn_q.weight", 1, [H, heads * hd], f16(H * heads * hd, rng)),
              (p + "attn_k.weight", 1, [H, kv * hd], f16(H * kv * hd, rng)),
              (p + "attn_v.weight", 8, [H, kv * hd], q8_0(H * kv * hd, rng)),
              (p + "attn_output.weight", 2, [heads * hd, H], q4_0(H * heads * hd, rng)),
              (p + "ffn_norm.weight", 0, [H], f32(H, rng)),
              (p + "ffn_gate.weight", 2, [H, F], q4_0(H * F, rng)),
              (p + "ffn_up.weight", 0, [H, F], f32(H * F, rng)),
              (p + "ffn_down.weight", 1, [F, H], f16(F * H, rng))]
    return gguf(kvs, t, magic)


def spm_vocab():
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]
    words = ["\u2581", "\u2581H", "ello", "\u2581w", "orld", "\u2581the", "\u2581\u2581", "e", "l", "o", "r", "d", "H", "w", "1", "2", "3"]
    tokens += words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    return [("tokenizer.ggml.model", 8, "llama"), ("tokenizer.ggml.tokens", 9, (8, tokens)),
            ("tokenizer.ggml.scores", 9, (6, scores)), ("tokenizer.ggml.token_type", 9, (5, types)),
            ("tokenizer.ggml.bos_token_id", 4, 1), ("tokenizer.ggml.eos_token_id", 4, 2)], len(tokens)


def bpe_vocab():
    # GPT-2 byte-to-unicode alphabet, then a few merges.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    tokens = [chr(c) for c in cs]
    merges = ["\u0120 w", "o r", "\u0120w or", "l d", "H e", "He l", "Hel l", "Hell o"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    tokens += ["<|begin_of_text|>", "<|end_of_text|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return [("tokenizer.ggml.model", 8, "gpt2"), ("tokenizer.ggml.pre", 8, "llama-bpe"),
            ("tokenizer.ggml.tokens", 9, (8, tokens)), ("tokenizer.ggml.token_type", 9, (5, types)),
            ("tokenizer.ggml.merges", 9, (8, merges)),
            ("tokenizer.ggml.bos_token_id", 4, len(tokens) - 2),
            ("tokenizer.ggml.eos_token_id", 4, len(tokens) - 1)], len(tokens)


def safetensors(tensors):
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + data


def main():
    rng = random.Random(1)
    for sub in ("gguf", "safetensors", "config"):
        os.makedirs(os.path.join(OUT, sub), exist_ok=True)

    def put(sub, name, data):
        with open(os.path.join(OUT, sub, name), "wb") as f:
            f.write(data)

    spm, n_spm = spm_vocab()
    bpe, n_bpe = bpe_vocab()
    put("gguf", "llama-spm", tiny_llama(rng, spm, n_spm))
    put("gguf", "llama-bpe-relu", tiny_llama(rng, bpe, n_bpe, "relu"))
    put("gguf", "powerinfer", tiny_llama(rng, [], 64, "drelu", magic=b"PWRI"))
    put("gguf", "qwen2-kquant", tiny_qwen2_kquant(random.Random(2), spm, n_spm))
    put("gguf", "all-value-types", gguf(
        [("u8", 0, 1), ("i8", 1, -1), ("u16", 2, 2), ("i16", 3, -2), ("u32", 4, 3), ("i32", 5, -3),
         ("f32", 6, 0.5), ("bool", 7, True), ("str", 8, "x"), ("u64", 10, 4), ("i64", 11, -4),
         ("f64", 12, 0.25), ("arr", 9, (4, [1, 2, 3])), ("sarr", 9, (8, ["a", "bc"])),
         ("general.alignment", 4, 16)],
        [("idx", 26, [4], struct.pack("<4i", 0, 1, 2, 3)), ("bf", 30, [8], b"\0" * 16)],
        alignment=16))
    put("safetensors", "mixed", safetensors([
        ("a", "F32", [2, 3], f32(6, rng)), ("b", "F16", [4], f16(4, rng)),
        ("c", "BF16", [1, 2], b"\x80\x3f\x00\x40"), ("scalar", "F32", [], f32(1, rng))]))
    put("safetensors", "empty", safetensors([]))
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096,
            "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6,
            "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 1536,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "relu",
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    put("config", "relu", json.dumps(base, indent=2).encode())
    llama3 = dict(base, hidden_act="silu", rope_theta=500000.0, eos_token_id=[2, 3],
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    del llama3["rope_parameters"]
    put("config", "llama3", json.dumps(llama3).encode())


if __name__ == "__main__":
    main()
