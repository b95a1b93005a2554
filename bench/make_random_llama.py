#!/usr/bin/python3
"""Writes a random-weight SiLU Llama in Hugging Face format (F16 safetensors) for benchmarks.

The default shape has about 100M parameters (hidden 768, 12 layers, 12 heads, FFN 2048, vocab
4096), large enough that per-token overhead does not dominate. The tokenizer is copied from the
bundled model so that the directory is complete.

usage: make_random_llama.py OUT_DIR [--hidden H] [--layers L] [--heads N] [--kv-heads K] [--ffn F]
"""
import argparse
import json
import os
import shutil
import struct

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--hidden", type=int, default=768)
p.add_argument("--layers", type=int, default=12)
p.add_argument("--heads", type=int, default=12)
p.add_argument("--kv-heads", type=int, default=12)
p.add_argument("--ffn", type=int, default=2048)
p.add_argument("--vocab", type=int, default=4096)
p.add_argument("--act", default="silu")
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)
rng = np.random.default_rng(0)
H, F, V, hd = a.hidden, a.ffn, a.vocab, a.hidden // a.heads
shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
for l in range(a.layers):
    pre = f"model.layers.{l}."
    shapes.update({pre + "input_layernorm.weight": (H,), pre + "post_attention_layernorm.weight": (H,),
                   pre + "self_attn.q_proj.weight": (a.heads * hd, H),
                   pre + "self_attn.k_proj.weight": (a.kv_heads * hd, H),
                   pre + "self_attn.v_proj.weight": (a.kv_heads * hd, H),
                   pre + "self_attn.o_proj.weight": (H, a.heads * hd),
                   pre + "mlp.gate_proj.weight": (F, H), pre + "mlp.up_proj.weight": (F, H),
                   pre + "mlp.down_proj.weight": (H, F)})
header, offset = {}, 0
for name, shape in shapes.items():
    n = int(np.prod(shape)) * 2
    header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + n]}
    offset += n
h = json.dumps(header).encode()
h += b" " * ((8 - len(h) % 8) % 8)
with open(os.path.join(a.out, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h)
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            w = np.ones(shape)
        else:
            w = rng.normal(0, 1 / np.sqrt(shape[-1]), shape)
        f.write(w.astype(np.float16).tobytes())
json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": F, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
           "num_key_value_heads": a.kv_heads, "vocab_size": V, "hidden_act": a.act,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
          open(os.path.join(a.out, "config.json"), "w"), indent=1)
here = os.path.dirname(os.path.abspath(__file__))
shutil.copy(os.path.join(here, "..", "models", "relu-llama-tiny", "tokenizer.model"), a.out)
print(f"wrote {a.out}: {sum(int(np.prod(s)) for s in shapes.values()) / 1e6:.1f}M parameters")
