#!/usr/bin/env python3
"""Every matrix product of one training step, each timed alone with cuBLAS (torch.matmul in
bf16, CUDA events): what the step's GEMMs cost at cuBLAS's speed for their shapes, the yardstick
that breakdown.py holds an implementation's GEMM time against.

    python3 gemm_shapes.py --model gpt-1.3b --micro-batch 4 [--json OUT] > OUT.md
    python3 gemm_shapes.py --model llama-3.2-1b --micro-batch 3 --layout fused,separate
    python3 gemm_shapes.py --hidden 2048 --ffn 8192 --layers 16 --heads 32 --kv-heads 8 \\
        --vocab 128256 --seq 2048 --mlp swiglu --micro-batch 3
    python3 gemm_shapes.py --model gpt-1.3b --micro-batch 4 --dry-run   # the shapes; no GPU

A linear layer y = x·Wᵀ (x: tokens × in, W: out × in) runs three products per micro-step, each
with its operands laid out as autograd lays them:
  forward  x·Wᵀ    M = tokens, N = out, K = in
  dX       dy·W    M = tokens, N = in,  K = out
  dW       dyᵀ·x   M = out,    N = in,  K = tokens
for the attention's q/k/v and output projections, the MLP's (fc1, fc2; or gate, up, down) and
the LM head. Attention's own products (scores, probabilities × values) run inside the
attention kernels and are not GEMMs here.

Layouts: `separate` runs q, k, v and gate, up as products of their own (transformers' Llama);
`fused` runs one q|k|v and one gate|up product (our engine). GPT blocks have one qkv product in
both (torch_ref.py's too). Each distinct (product, M, N, K) is timed once: a warm-up, then the
median of --reps launches. Needs PyTorch with CUDA, except --dry-run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Shape:
    """What the products of a decoder depend on."""
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    mlp: str  # "gelu" (fc1, fc2) or "swiglu" (gate, up, down)


def _gpt(d, heads, layers):
    return Shape(d, 4 * d, layers, heads, heads, 50_257, 1024, "gelu")


def _decoder(hidden, ffn, layers, heads, kv_heads, vocab):
    return Shape(hidden, ffn, layers, heads, kv_heads, vocab, 2048, "swiglu")


# The presets of crates/core/src/spec/model.rs and model/presets.rs (GPT: sequences of 1024,
# feed-forward 4·d; the decoders: sequences of 2048, their published configs).
PRESETS = {
    "gpt-124m": _gpt(768, 12, 12),
    "gpt-350m": _gpt(1024, 16, 24),
    "gpt-1.3b": _gpt(2048, 16, 24),
    "gpt-2b": _gpt(2560, 20, 24),
    "smollm2-135m": _decoder(576, 1536, 30, 9, 3, 49_152),
    "qwen2.5-0.5b": _decoder(896, 4864, 24, 14, 2, 151_936),
    "llama-3.2-1b": _decoder(2048, 8192, 16, 32, 8, 128_256),
    "qwen2.5-1.5b": _decoder(1536, 8960, 28, 12, 2, 151_936),
    "llama-3.2-3b": _decoder(3072, 8192, 28, 24, 8, 128_256),
    "mistral-7b": _decoder(4096, 14_336, 32, 32, 8, 32_000),
    "llama-3.1-8b": _decoder(4096, 14_336, 32, 32, 8, 128_256),
}
LAYOUTS = ("fused", "separate")
OPS = ("forward", "dX", "dW")


def linears(s: Shape, layout: str):
    """(name, in, out, count per micro-step) of every linear layer."""
    h, hd = s.hidden, s.hidden // s.heads
    q, kv = s.heads * hd, s.kv_heads * hd
    if s.mlp == "gelu" or layout == "fused":
        attn = [("qkv", h, q + 2 * kv)]
    else:
        attn = [("q", h, q), ("k", h, kv), ("v", h, kv)]
    attn.append(("attn out", q, h))
    if s.mlp == "gelu":
        mlp = [("fc1", h, s.ffn), ("fc2", s.ffn, h)]
    elif layout == "fused":
        mlp = [("gate|up", h, 2 * s.ffn), ("down", s.ffn, h)]
    else:
        mlp = [("gate", h, s.ffn), ("up", h, s.ffn), ("down", s.ffn, h)]
    return [(n, i, o, s.layers) for n, i, o in attn + mlp] + [("lm head", h, s.vocab, 1)]


def products(s: Shape, layout: str, tokens: int, accum: int = 1):
    """The distinct products of one optimizer step: dicts with op, m, n, k, names and count."""
    found = {}
    for name, i, o, count in linears(s, layout):
        for op, (m, n, k) in zip(OPS, ((tokens, o, i), (tokens, i, o), (o, i, tokens))):
            entry = found.setdefault((op, m, n, k), {"op": op, "m": m, "n": n, "k": k,
                                                     "names": [], "count": 0})
            entry["names"].append(f"{name} {op}")
            entry["count"] += count * accum
    return list(found.values())


def flops(p):
    return 2 * p["m"] * p["n"] * p["k"] * p["count"]


# ---- timing (PyTorch) ----------------------------------------------------------------------------

def operands(torch, op, m, n, k):
    """A (M×K) and B (K×N) in the memory layout autograd gives them for `op`."""
    def r(*size):
        return torch.randn(*size, device="cuda", dtype=torch.bfloat16)
    if op == "forward":
        return r(m, k), r(n, k).t()  # x · Wᵀ, W stored out × in
    if op == "dX":
        return r(m, k), r(k, n)  # dy · W
    return r(k, m).t(), r(k, n)  # dyᵀ · x


def time_product(torch, op, m, n, k, warmup, reps):
    """Median milliseconds of one product over `reps` launches queued back to back."""
    a, b = operands(torch, op, m, n, k)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(warmup):
        torch.matmul(a, b, out=c)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        torch.matmul(a, b, out=c)
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(start.elapsed_time(end) for start, end in events)
    del a, b, c
    torch.cuda.empty_cache()
    return ms


def spin_up(torch, seconds=1.0):
    """Matrix products for about `seconds`, so that the first shape timed does not meet the GPU
    at its idle clocks."""
    import time
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def time_all(table, warmup, reps):
    """Fills `ms` of every product of every layout, each distinct shape timed once."""
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("gemm_shapes.py: CUDA is not available (--dry-run lists the shapes)")
    spin_up(torch)
    cache = {}
    for entries in table.values():
        for p in entries:
            key = (p["op"], p["m"], p["n"], p["k"])
            if key not in cache:
                cache[key] = time_product(torch, *key, warmup, reps)
            p["ms"] = cache[key]
            p["tflops"] = 2 * p["m"] * p["n"] * p["k"] / (p["ms"] / 1e3) / 1e12
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__}


# ---- output -------------------------------------------------------------------------------------

def summary(entries):
    """FLOPs and cuBLAS milliseconds of one layout's step (ms None when not timed)."""
    timed = all(p.get("ms") is not None for p in entries)
    return {"products": entries, "flops_per_step": sum(flops(p) for p in entries),
            "cublas_ms_per_step": sum(p["ms"] * p["count"] for p in entries) if timed else None}


def render(doc):
    lines = [f"# GEMMs of one step: {doc['model']}, micro-batch {doc['micro_batch']}, "
             f"{doc['tokens_per_step']:,} tokens per step", ""]
    if doc.get("device"):
        lines += [f"cuBLAS through torch.matmul (torch {doc['torch']}) on {doc['device']}, bf16; "
                  f"median of {doc['reps']} launches.", ""]
    for layout, entry in doc["layouts"].items():
        lines += [f"## {layout} layout", "",
                  "| products | M | N | K | count/step | cuBLAS ms | ms/step | TFLOP/s |",
                  "|---|--:|--:|--:|--:|--:|--:|--:|"]
        for p in entry["products"]:
            ms = p.get("ms")
            lines.append(f"| {', '.join(p['names'])} | {p['m']} | {p['n']} | {p['k']} | "
                         f"{p['count']} | {fmt(ms, '.3f')} | {fmt(ms and ms * p['count'], '.2f')} | "
                         f"{fmt(p.get('tflops'), '.0f')} |")
        total_ms = entry["cublas_ms_per_step"]
        rate = entry["flops_per_step"] / (total_ms / 1e3) / 1e12 if total_ms else None
        lines += ["", f"GEMM FLOPs per step: {entry['flops_per_step'] / 1e12:.3f} TFLOP; "
                      f"cuBLAS time per step: {fmt(total_ms, '.2f')} ms "
                      f"({fmt(rate, '.0f')} TFLOP/s).", ""]
    return "\n".join(lines)


def fmt(value, spec):
    return "–" if value is None else format(value, spec)


# ---- command line -------------------------------------------------------------------------------

def shape_of(a):
    """The preset, with any dimension given on the command line in its place."""
    base = asdict(PRESETS[a.model]) if a.model else {}
    for field in Shape.__dataclass_fields__:
        value = getattr(a, field, None)
        if value is not None:
            base[field] = value
    if "heads" in base:
        base.setdefault("kv_heads", base["heads"])  # no grouped-query attention
    missing = [f.replace("_", "-") for f in Shape.__dataclass_fields__ if f not in base]
    if missing:
        raise SystemExit(f"gemm_shapes.py: give --model or --{' --'.join(missing)}")
    return Shape(**base)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(PRESETS))
    for dim in ("hidden", "ffn", "layers", "heads", "kv-heads", "vocab", "seq"):
        ap.add_argument(f"--{dim}", type=int, dest=dim.replace("-", "_"))
    ap.add_argument("--mlp", choices=("gelu", "swiglu"))
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--layout", default=",".join(LAYOUTS),
                    help="comma-separated: fused, separate (default both)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=30, help="timed launches per shape (≥ 20)")
    ap.add_argument("--dry-run", action="store_true", help="list the products; time nothing")
    ap.add_argument("--json", help="write the table here as JSON too")
    a = ap.parse_args(argv)
    a.layouts = [x for x in a.layout.split(",") if x]
    if not a.layouts or any(x not in LAYOUTS for x in a.layouts):
        ap.error(f"--layout takes {', '.join(LAYOUTS)}")
    if a.reps < 20 and not a.dry_run:
        ap.error("--reps must be at least 20")
    return a


def build(a):
    """The document: the model, the step's tokens and each layout's products."""
    s = shape_of(a)
    tokens = a.micro_batch * s.seq
    table = {layout: products(s, layout, tokens, a.grad_accum) for layout in a.layouts}
    return s, tokens, table


def main(argv=None):
    a = parse(argv)
    s, tokens, table = build(a)
    device = {} if a.dry_run else time_all(table, a.warmup, a.reps)
    doc = {"model": a.model or "custom", "shape": asdict(s), "micro_batch": a.micro_batch,
           "grad_accum": a.grad_accum, "tokens_per_step": tokens * a.grad_accum,
           "reps": a.reps, **device,
           "layouts": {layout: summary(entries) for layout, entries in table.items()}}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
