#!/usr/bin/env python3
"""PyTorch eager reference for the GPU benchmark.

Builds the same models as autotune's presets (crates/core/src/spec/model.rs), runs the same
training loop (zero_grad, forward, loss, backward, optimizer step) and prints one
JSON line per (model, precision, micro_batch) with the same fields as
`autotune probe --json`, so that compare.py can put the two side by side.

    python3 torch_ref.py --model seed --precision bf16 --micro-batch 32,128,512
    python3 torch_ref.py --self-test        # CPU only: tiny model + parameter counts

JSON goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------
# Model presets (must stay in step with crates/core/src/spec/model.rs)
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Preset:
    name: str
    kind: str  # "seed" (nn.TransformerEncoder) or "gpt" (decoder-only, pre-norm)
    vocab: int
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    seq_len: int
    # Parameter count we expect, in the units used when the presets were specified;
    # the self-test checks the built model against it.
    expected_params: float


def _gpt(name: str, d: int, heads: int, layers: int, expected: float) -> Preset:
    return Preset(name, "gpt", 50257, d, heads, layers, 4 * d, 1024, expected)


PRESETS = {
    "seed": Preset("seed", "seed", 10000, 512, 8, 6, 2048, 128, 29.2e6),
    "gpt-124m": _gpt("gpt-124m", 768, 12, 12, 163e6),
    "gpt-350m": _gpt("gpt-350m", 1024, 16, 24, 406e6),
    "gpt-1.3b": _gpt("gpt-1.3b", 2048, 16, 24, 1.42e9),
    "gpt-2b": _gpt("gpt-2b", 2560, 20, 24, 2.15e9),
    "tiny": Preset("tiny", "gpt", 256, 64, 4, 2, 256, 64, 0.0),  # exact count checked by formula only
}


class SeedModel(nn.Module):
    """The model users start from: Embedding -> 6 post-norm encoder layers -> Linear.

    No positional encoding and no mask, exactly like the original article's code,
    so that the comparison measures the same arithmetic.
    """

    def __init__(self, p: Preset):
        super().__init__()
        self.embed = nn.Embedding(p.vocab, p.d_model)
        layer = nn.TransformerEncoderLayer(
            p.d_model, p.n_heads, dim_feedforward=p.d_ff, dropout=0.1,
            activation="relu", batch_first=True, norm_first=False,
        )
        # enable_nested_tensor only matters for padded inference; turning it off
        # silences a warning and changes nothing in training.
        self.encoder = nn.TransformerEncoder(layer, p.n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(p.d_model, p.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


class GptBlock(nn.Module):
    """Pre-norm decoder block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, p: Preset):
        super().__init__()
        self.n_heads = p.n_heads
        self.ln1 = nn.LayerNorm(p.d_model, eps=1e-5)
        self.qkv = nn.Linear(p.d_model, 3 * p.d_model)
        self.proj = nn.Linear(p.d_model, p.d_model)
        self.ln2 = nn.LayerNorm(p.d_model, eps=1e-5)
        self.fc1 = nn.Linear(p.d_model, p.d_ff)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(p.d_ff, p.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        # (B, T, D) -> (B, H, T, D/H), the layout SDPA expects.
        q, k, v = (y.view(b, t, h, d // h).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class GptModel(nn.Module):
    """Decoder-only GPT: token + learned position embeddings, pre-norm blocks,
    final LayerNorm, untied output head with bias. Dropout is 0 so it is omitted."""

    def __init__(self, p: Preset):
        super().__init__()
        self.wte = nn.Embedding(p.vocab, p.d_model)
        self.wpe = nn.Embedding(p.seq_len, p.d_model)
        self.blocks = nn.ModuleList(GptBlock(p) for _ in range(p.n_layers))
        self.ln_f = nn.LayerNorm(p.d_model, eps=1e-5)
        self.head = nn.Linear(p.d_model, p.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(p: Preset) -> nn.Module:
    return SeedModel(p) if p.kind == "seed" else GptModel(p)


def build_optimizer(p: Preset, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    if p.kind == "seed":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    # Fused AdamW is what a tuned PyTorch user runs on GPU; the CPU self-test uses
    # the default implementation so it works on any build.
    return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                             weight_decay=0.1, fused=device.type == "cuda")


def count_params(model: nn.Module) -> int:
    return sum(t.numel() for t in model.parameters())


def formula_params(p: Preset) -> int:
    """Closed-form parameter count, an independent check of the module code."""
    d, f, v = p.d_model, p.d_ff, p.vocab
    # attention (fused in-proj + out-proj, with biases) + MLP + two LayerNorms
    layer = (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    if p.kind == "seed":
        return v * d + p.n_layers * layer + (d * v + v)
    return v * d + p.seq_len * d + p.n_layers * layer + 2 * d + (d * v + v)


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def percentile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), without numpy."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    # cuBLAS / cuDNN report allocation failures as plain RuntimeErrors.
    msg = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in msg or "ALLOC_FAILED" in msg)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_steps(p: Preset, precision: str, micro_batch: int, warmup: int, steps: int,
                device: torch.device, seed: int, compile_model: bool = False,
                profiler_range: bool = False) -> dict:
    """Builds model + optimizer, runs warm-up and timed steps, returns the measurements.

    Everything lives in this function's frame so that returning (or raising) drops
    every tensor and the caller can hand the memory back to the driver.
    """
    torch.manual_seed(seed)
    dtype = DTYPES[precision]
    model = build_model(p).to(device)
    model.train()
    params = count_params(model)
    if compile_model:
        # What a tuned PyTorch user runs: inductor's default mode. Compilation happens in the
        # first (warm-up) steps and is not timed.
        model = torch.compile(model)
    opt = build_optimizer(p, model, device)
    # GradScaler is only needed for fp16: bf16 has fp32's exponent range.
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    # Inputs and targets are independent uniform random tokens, made once on the
    # device so that data generation is not timed.
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = torch.randint(0, p.vocab, (micro_batch, p.seq_len), device=device, generator=gen)
    targets = torch.randint(0, p.vocab, (micro_batch, p.seq_len), device=device, generator=gen)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        # autocast keeps fp32 master weights and casts per op, as mixed precision does.
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, p.vocab), targets.reshape(-1))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        return loss

    if device.type == "cuda":
        # Peak includes weights and optimizer state already resident, like ours.
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        loss = step()
    sync(device)

    # A profiler started with its collection off (ncu --profile-from-start off) sees the timed
    # steps alone: not the warm-up, and not torch.compile's compilation in it.
    profiling = profiler_range and device.type == "cuda"
    if profiling:
        torch.cuda.cudart().cudaProfilerStart()
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        loss = step()
        sync(device)
        times.append(time.perf_counter() - t0)
    if profiling:
        torch.cuda.cudart().cudaProfilerStop()

    final_loss = float(loss.detach().float().item()) if steps + warmup > 0 else float("nan")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    return {"times": times, "params": params, "peak": peak, "reserved": reserved, "loss": final_loss}


def record(p: Preset, precision: str, micro_batch: int, params: int | None, **fields) -> dict:
    out = {
        "impl": "pytorch", "model": p.name, "precision": precision,
        "micro_batch": micro_batch, "seq_len": p.seq_len,
        "outcome": "out_of_memory", "step_time_median_s": None, "step_time_spread": None,
        "tokens_per_s": None, "peak_gpu_bytes": None, "peak_reserved_bytes": None,
        "timed_steps": 0, "params": params,
    }
    out.update(fields)
    return out


def measure(p: Preset, precision: str, micro_batch: int, warmup: int, steps: int,
            device: torch.device, seed: int, compile_model: bool = False,
            profiler_range: bool = False) -> dict:
    oom = False
    try:
        r = train_steps(p, precision, micro_batch, warmup, steps, device, seed, compile_model,
                        profiler_range)
    except Exception as exc:  # noqa: BLE001 - only OOM is an expected outcome
        if not is_oom(exc):
            raise
        oom = True
        print(f"  {p.name} {precision} mb={micro_batch}: out of memory", file=sys.stderr)
    # Freed outside the except block: the traceback keeps the failing frame (and
    # its tensors) alive until the handler is left.
    gc.collect()
    if device.type == "cuda":
        # max_memory_reserved is read before this, so the cache flush does not hide it.
        torch.cuda.empty_cache()
    if oom:
        return record(p, precision, micro_batch, formula_params(p),
                      impl="pytorch-compile" if compile_model else "pytorch")

    times = sorted(r["times"])
    median = percentile(times, 0.5)
    spread = (percentile(times, 0.9) - percentile(times, 0.1)) / median if median > 0 else None
    tokens = micro_batch * p.seq_len
    peak = "n/a" if r["peak"] is None else f"{r['peak'] / 2**30:.2f} GiB"
    print(f"  {p.name} {precision} mb={micro_batch}: {median * 1e3:.1f} ms/step, "
          f"{tokens / median:,.0f} tok/s, peak {peak}, loss {r['loss']:.3f}", file=sys.stderr)
    return record(
        p, precision, micro_batch, r["params"], outcome="fits",
        impl="pytorch-compile" if compile_model else "pytorch",
        step_time_median_s=median, step_time_spread=spread, tokens_per_s=tokens / median,
        peak_gpu_bytes=r["peak"], peak_reserved_bytes=r["reserved"], timed_steps=len(times),
    )


# ---------------------------------------------------------------------------
# Self-test (no GPU needed)
# ---------------------------------------------------------------------------

def self_test() -> int:
    failures = []
    for name, p in PRESETS.items():
        # Meta tensors have shapes but no storage: even gpt-1.3b costs nothing here.
        with torch.device("meta"):
            n = count_params(build_model(p))
        want = formula_params(p)
        ok = n == want and (p.expected_params == 0 or abs(n - p.expected_params) / p.expected_params < 0.01)
        print(f"{name:9s} {n:>14,d} params (formula {want:,d}) {'ok' if ok else 'MISMATCH'}", file=sys.stderr)
        if not ok:
            failures.append(name)

    cpu = torch.device("cpu")
    # Every precision path (autocast, GradScaler) on the tiny model; the seed model
    # once, to exercise nn.TransformerEncoder and Adam.
    for name, precision in (("tiny", "fp32"), ("tiny", "bf16"), ("tiny", "fp16"), ("seed", "fp32")):
        r = measure(PRESETS[name], precision, 2, warmup=1, steps=2, device=cpu, seed=0)
        if r["outcome"] != "fits" or r["timed_steps"] != 2 or not r["tokens_per_s"]:
            failures.append(f"{name}/{precision}")
        print(json.dumps(r))

    if failures:
        print(f"self-test FAILED: {', '.join(failures)}", file=sys.stderr)
        return 1
    print("self-test ok", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(PRESETS), default="seed")
    ap.add_argument("--precision", choices=list(DTYPES), default="fp32")
    ap.add_argument("--micro-batch", default="32",
                    help="comma-separated micro-batch sizes, each measured separately")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cap-mib", type=int, default=None,
                    help="limit the caching allocator to this many MiB (e.g. 24052 to emulate "
                         "a 24 GB card minus its CUDA context); omitted = whole GPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true",
                    help="run the model under torch.compile (inductor, default mode)")
    ap.add_argument("--profiler-range", action="store_true",
                    help="run only the timed steps between cudaProfilerStart and Stop, for a "
                         "profiler started with its collection off (ncu --profile-from-start off)")
    ap.add_argument("--self-test", action="store_true",
                    help="check parameter counts and run a few CPU steps; no GPU needed")
    args = ap.parse_args()

    if args.self_test:
        return self_test()

    try:
        batches = [int(b) for b in args.micro_batch.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--micro-batch must be a comma-separated list of integers, got {args.micro_batch!r}")
    if not batches or min(batches) < 1:
        ap.error("--micro-batch needs at least one size >= 1")
    if args.steps < 1:
        ap.error("--steps must be at least 1")

    if not torch.cuda.is_available():
        print("torch_ref.py: CUDA is not available (use --self-test on a CPU machine)", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(device)
    if args.cap_mib is not None:
        cap = args.cap_mib * 2**20
        if cap >= props.total_memory:
            print(f"torch_ref.py: --cap-mib {args.cap_mib} is not below the device's "
                  f"{props.total_memory // 2**20} MiB; running uncapped", file=sys.stderr)
        else:
            torch.cuda.set_per_process_memory_fraction(cap / props.total_memory, device)
    print(f"torch {torch.__version__} on {props.name} ({props.total_memory / 2**30:.1f} GiB)"
          f"{'' if args.cap_mib is None else f', capped at {args.cap_mib} MiB'}", file=sys.stderr)

    p = PRESETS[args.model]
    for b in batches:
        r = measure(p, args.precision, b, args.warmup, args.steps, device, args.seed, args.compile,
                    args.profiler_range)
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
