#!/usr/bin/env python3
"""DeepSpeed ZeRO-2 with the optimizer offloaded to the CPU (ZeRO-Offload), the reference for
autotune's optimizer offload: the same GPT model as torch_ref.py, AdamW, bf16, one GPU.

    PYTHONPATH=/tmp/site python3 deepspeed_ref.py --model gpt-1.3b --micro-batch 4 \\
        --cap-mib 24052 > ds.jsonl

Prints one JSON line per micro-batch with the fields of `autotune probe --json` ("impl":
"deepspeed"), plus `peak_host_rss_bytes`, the process's peak resident memory (what a 32 GB
host must hold). DeepSpeed's CPU Adam compiles itself at first use (about a minute). It runs
as one rank of a group of one (RANK=0, WORLD_SIZE=1).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ref import PRESETS, build_model, count_params, is_oom, percentile  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_config(micro_batch: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        # The step autotune measures has no clipping; DeepSpeed's default would clip at 1.0.
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def measure(name: str, micro_batch: int, warmup: int, steps: int) -> dict:
    import deepspeed

    p = PRESETS[name]
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = build_model(p)
    params = count_params(model)
    out = {
        "impl": "deepspeed", "model": name, "precision": "bf16", "micro_batch": micro_batch,
        "seq_len": p.seq_len, "params": params, "outcome": "out_of_memory",
        "step_time_median_s": None, "step_time_spread": None, "tokens_per_s": None,
        "peak_gpu_bytes": None, "timed_steps": 0,
    }
    try:
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(micro_batch)
        )
        gen = torch.Generator(device=device).manual_seed(0)
        inputs = torch.randint(0, p.vocab, (micro_batch, p.seq_len), device=device, generator=gen)
        targets = torch.randint(0, p.vocab, (micro_batch, p.seq_len), device=device, generator=gen)
        torch.cuda.reset_peak_memory_stats(device)
        times = []
        for i in range(warmup + steps):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            logits = engine(inputs)
            loss = F.cross_entropy(logits.float().reshape(-1, p.vocab), targets.reshape(-1))
            engine.backward(loss)
            engine.step()
            torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - only OOM is an expected outcome
        if not is_oom(exc):
            raise
        print(f"  deepspeed {name} mb={micro_batch}: out of memory", file=sys.stderr)
        return out
    times.sort()
    median = percentile(times, 0.5)
    out.update(
        outcome="fits", step_time_median_s=median,
        step_time_spread=(percentile(times, 0.9) - percentile(times, 0.1)) / median,
        tokens_per_s=micro_batch * p.seq_len / median, timed_steps=len(times),
        peak_gpu_bytes=torch.cuda.max_memory_allocated(device),
        # ru_maxrss is in KiB on Linux.
        peak_host_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    print(f"  deepspeed {name} mb={micro_batch}: {median * 1e3:.0f} ms/step, "
          f"{out['tokens_per_s']:,.0f} tok/s, GPU {out['peak_gpu_bytes'] / 2**30:.2f} GiB, "
          f"host RSS {out['peak_host_rss_bytes'] / 2**30:.2f} GiB", file=sys.stderr)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(PRESETS), default="gpt-1.3b")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cap-mib", type=int, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("deepspeed_ref.py: CUDA is not available", file=sys.stderr)
        return 2
    for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        os.environ.setdefault(var, value)
    device = torch.device("cuda", 0)
    if args.cap_mib is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_mib * 2**20 / total, device)
    import deepspeed

    deepspeed.init_distributed()
    print(json.dumps(measure(args.model, args.micro_batch, args.warmup, args.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
