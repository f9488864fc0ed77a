#!/usr/bin/env python3
"""PyTorch eager reference for the decoder presets: `transformers`' own LlamaForCausalLM /
Qwen2ForCausalLM built from the published config (tests/fixtures/hf/published/), random
weights, SDPA attention, float32 master weights under bf16 autocast, fused AdamW (autotune's
defaults: lr 3e-4, betas 0.9/0.95, weight decay 0.1), cross-entropy on random tokens.

One JSON line per micro-batch on stdout with the fields of `autotune probe --json`
(outcome, step_time_median_s, tokens_per_s, peak_gpu_bytes, ...), progress on stderr:

    python3 llama_ref.py --model llama-3.2-1b --seq 2048 --micro-batch 1,2,4 [--cap-mib N]
    python3 llama_ref.py --self-test          # CPU: the configs build to the published counts

--liger swaps in Liger's kernels for Llama and Qwen2 (RoPE, RMSNorm, SwiGLU, and the fused
linear cross-entropy, which never materialises the logits: the loss comes from the model given
the labels); --compile wraps the model in torch.compile (its first steps compile: raise
--warmup); with --liger, the decoder alone, since Liger's fused loss does not trace (it runs
eagerly after the compiled decoder). Both together are the strongest PyTorch stack for these
models.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# This folder's kernels.py would shadow the `kernels` package transformers imports.
sys.path = [p for p in sys.path if pathlib.Path(p or ".").resolve() != HERE]
CONFIGS = {
    "llama-3.2-1b": ("Llama-3.2-1B.json", 1_235_814_400),
    "qwen2.5-0.5b": ("Qwen2.5-0.5B.json", 494_032_768),
    "qwen2.5-1.5b": ("Qwen2.5-1.5B.json", 1_543_714_304),
    "smollm2-135m": ("SmolLM2-135M.json", 134_515_008),
    "llama-3.2-3b": ("Llama-3.2-1B.json", None),
}


def build(name: str, device, attn: str = "sdpa"):
    import transformers

    path = ROOT / "tests/fixtures/hf/published" / CONFIGS[name][0]
    config = transformers.AutoConfig.from_pretrained(path)
    config._attn_implementation = attn
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    return model, config


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def apply_liger(name: str) -> None:
    """Patches transformers' model classes with Liger's kernels (before the model is built)."""
    import liger_kernel.transformers as liger

    patch = liger.apply_liger_kernel_to_llama if name.startswith(("llama", "smollm2")) \
        else liger.apply_liger_kernel_to_qwen2
    patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
          fused_linear_cross_entropy=True)


def measure(name, mb, seq, warmup, steps, device, checkpointing=False, liger=False,
            compiled=False):
    model, config = build(name, device)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    params = sum(p.numel() for p in model.parameters())
    forward = model
    if compiled and liger:
        # Liger's fused linear cross-entropy does not trace under torch.compile since PyTorch
        # 2.8 (its grad_weight addmm with out_dtype and out, linkedin/Liger-Kernel#1327; eager
        # is unaffected): the decoder is compiled and the loss runs eagerly, as in the issue's
        # workaround.
        model.model = torch.compile(model.model)
    elif compiled:
        forward = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=device.type == "cuda")
    vocab = config.vocab_size
    g = torch.Generator(device=device).manual_seed(0)
    inputs = torch.randint(0, vocab, (mb, seq), device=device, generator=g)
    targets = torch.randint(0, vocab, (mb, seq), device=device, generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if liger:
                # The fused linear cross-entropy takes the labels and returns only the loss.
                loss = forward(input_ids=inputs, labels=targets).loss
            else:
                logits = forward(input_ids=inputs).logits
                loss = F.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1))
        loss.backward()
        opt.step()
        return loss

    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    return {
        "impl": impl_name(liger, compiled), "model": name, "precision": "bf16", "micro_batch": mb,
        "seq_len": seq, "checkpointing": checkpointing, "outcome": "fits",
        "step_time_median_s": median,
        "step_time_spread": (times[int(0.9 * (len(times) - 1))] - times[int(0.1 * (len(times) - 1))]) / median,
        "tokens_per_s": mb * seq / median, "peak_gpu_bytes": torch.cuda.max_memory_allocated(device),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device), "timed_steps": steps,
        "params": params, "loss": float(loss.item()),
    }


def impl_name(liger: bool, compiled: bool) -> str:
    return "pytorch-transformers" + ("+liger" if liger else "") + ("+compile" if compiled else "")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(CONFIGS))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", default="1,2")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cap-mib", type=int, default=0)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--liger", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        ok = True
        for name, (_, want) in CONFIGS.items():
            if want is None:
                continue
            model, _ = build(name, torch.device("meta"), attn="eager")
            n = sum(p.numel() for p in model.parameters())
            print(f"{name}: {n:,} parameters (published {want:,})", file=sys.stderr)
            ok &= n == want
        return 0 if ok else 1
    device = torch.device("cuda", 0)
    if a.liger:
        apply_liger(a.model)
    if a.cap_mib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(a.cap_mib * 2**20 / total, device)
    for mb in [int(x) for x in a.micro_batch.split(",")]:
        try:
            r = measure(a.model, mb, a.seq, a.warmup, a.steps, device, a.checkpointing,
                        a.liger, a.compile)
        except Exception as exc:  # noqa: BLE001 - only OOM is an expected outcome
            if not is_oom(exc):
                raise
            r = {"impl": impl_name(a.liger, a.compile), "model": a.model, "precision": "bf16",
                 "micro_batch": mb, "seq_len": a.seq, "checkpointing": a.checkpointing,
                 "outcome": "out_of_memory"}
        gc.collect()
        torch.cuda.empty_cache()
        print(json.dumps(r), flush=True)
        print(f"  {a.model} mb={mb}: {r['outcome']} {r.get('tokens_per_s') or 0:,.0f} tok/s "
              f"peak {(r.get('peak_gpu_bytes') or 0) / 2**30:.2f} GiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
