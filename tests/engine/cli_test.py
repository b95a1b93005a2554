#!/usr/bin/python3
"""The `pinfer generate` / `pinfer perplexity` command-line contract: flags, JSON fields, exit codes.

Generated tokens are checked against transformers' reference.json, not against earlier pinfer runs.
usage: cli_test.py PINFER_BINARY MODELS_DIR
"""
import json
import os
import subprocess
import sys
import tempfile

PINFER, MODELS = sys.argv[1], sys.argv[2]
MODEL = os.path.join(MODELS, "relu-llama-tiny")
REF = json.load(open(os.path.join(MODEL, "reference.json")))
failures = []
passed = 0


def run(*args):
    return subprocess.run([PINFER, *args], capture_output=True, text=True, timeout=300)


def check(name, cond, detail=""):
    global passed
    if cond:
        passed += 1
        print(f"ok   {name}")
    else:
        failures.append(name)
        print(f"FAIL {name} {detail}")


# Usage errors: message on stderr, exit code 2.
for name, args in [
    ("no command", []),
    ("unknown command", ["frobnicate"]),
    ("generate without --model", ["generate", "--prompt", "x"]),
    ("generate without --prompt", ["generate", "--model", MODEL]),
    ("generate unknown flag", ["generate", "--model", MODEL, "--prompt", "x", "--bogus", "1"]),
    ("generate bad integer", ["generate", "--model", MODEL, "--prompt", "x", "--max-tokens", "ten"]),
    ("generate negative temperature", ["generate", "--model", MODEL, "--prompt", "x", "--temperature", "-1"]),
    ("generate flag without value", ["generate", "--model", MODEL, "--prompt"]),
    ("perplexity without --window", ["perplexity", "--model", MODEL, "--tokens", "x.u32"]),
    ("perplexity window too small", ["perplexity", "--model", MODEL, "--tokens", "x.u32", "--window", "1"]),
]:
    r = run(*args)
    check(f"usage error: {name}", r.returncode == 2 and "usage" in r.stderr, f"rc={r.returncode} {r.stderr[:200]}")

# Runtime errors: exit code 1 with the reason.
r = run("generate", "--model", "/nonexistent/model", "--prompt", "x")
check("missing model is a runtime error", r.returncode == 1 and "does not exist" in r.stderr, r.stderr[:200])

# --json: the contract's fields; greedy tokens equal transformers'; --logits adds all logits.
p = REF["prompts"][3]
r = run("generate", "--model", MODEL, "--prompt", p["prompt"], "--max-tokens", "48", "--json", "--logits")
j = json.loads(r.stdout) if r.returncode == 0 else {}
for field in ["prompt_ids", "generated_ids", "text", "prompt_tokens_per_second", "generation_tokens_per_second",
              "last_prompt_logits"]:
    check(f"json has {field}", field in j)
check("json prompt_ids equal transformers' input_ids", j.get("prompt_ids") == p["input_ids"])
gen = j.get("generated_ids", [])
want = p["greedy_ids"][:len(gen)]
check("json greedy ids equal transformers' (up to an EOS stop)", len(gen) > 0 and gen == want and
      (len(gen) == 48 or gen[-1] == 2), f"{gen} vs {p['greedy_ids']}")
check("json logits cover the vocabulary", len(j.get("last_prompt_logits", [])) == 4096)

# Streaming mode: text on stdout, speeds on stderr.
r = run("generate", "--model", MODEL, "--prompt", p["prompt"], "--max-tokens", "8")
check("stream mode prints text and speeds", r.returncode == 0 and r.stdout.strip() != "" and "tokens/s" in r.stderr)

# Perplexity JSON over a small file: 3 windows of 64 from 200 tokens (the partial window is ignored).
with tempfile.NamedTemporaryFile(suffix=".u32", delete=False) as f:
    f.write(open(os.path.join(MODEL, "heldout-tokens.u32"), "rb").read()[:200 * 4])
r = run("perplexity", "--model", MODEL, "--tokens", f.name, "--window", "64", "--json")
os.unlink(f.name)
j = json.loads(r.stdout) if r.returncode == 0 else {}
check("perplexity json", j.get("tokens_scored") == 3 * 63 and j.get("perplexity", 0) > 1, str(j))

print(f"{passed} passed, {len(failures)} failed")
sys.exit(1 if failures else 0)
