"""Optimizer offload through DeepSpeed ZeRO-Offload: ZeRO stage 2 with the fp32 master weights,
the Adam moments and the update on the host (DeepSpeed's CPU Adam), as
``autotune export --format deepspeed`` writes it for an offloaded plan. DeepSpeed is imported
only when a trial asks for offload; without it, offloaded regimes answer ``unsupported`` (the
search then skips them) and everything else still runs.

The trial runs as a data-parallel group of one (RANK 0 of WORLD_SIZE 1, a free local port).
DeepSpeed keeps state in its process (the process group, its CPU Adam), so after an offloaded
trial the runner asks for a fresh process.
"""

from __future__ import annotations

import os
import socket
import time

from .memory import host_peak, is_out_of_memory, reset_host_peak
from .protocol import Request
from .trial import Failed, Hooks, Measured, Step, Unsupported, checkpoint_blocks

_initialized = False


def deepspeed_config(request: Request) -> dict:
    """The DeepSpeed config of an offloaded trial: the keys autotune's DeepSpeed export writes."""
    knobs = request.knobs
    o = request.model.get("optimizer", {})
    fp16 = knobs.precision == "fp16"
    config = {
        "train_micro_batch_size_per_gpu": knobs.micro_batch,
        "gradient_accumulation_steps": knobs.grad_accum,
        "train_batch_size": knobs.micro_batch * knobs.grad_accum,
        "gradient_clipping": o.get("grad_clip") or 0.0,
        "bf16": {"enabled": knobs.precision == "bf16"},
        "fp16": {"enabled": fp16},
        "optimizer": {
            "type": "AdamW" if o.get("kind", "adamw") == "adamw" else "Adam",
            "params": {"lr": o.get("lr", 1e-3), "betas": [o.get("beta1", 0.9), o.get("beta2", 0.999)],
                       "eps": o.get("eps", 1e-8), "weight_decay": o.get("weight_decay", 0.0)},
        },
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if fp16:
        config["fp16"].update(loss_scale=0, initial_scale_power=16, loss_scale_window=2000,
                              hysteresis=1, min_loss_scale=1)
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deepspeed():
    """DeepSpeed, initialised as a group of one; ``Failed('unsupported')`` when absent."""
    global _initialized
    try:
        import deepspeed
    except Exception as exc:  # noqa: BLE001 - any import failure means no offload here
        raise Failed("unsupported", "optimizer offload runs through DeepSpeed ZeRO-Offload, which "
                                    f"is not importable here ({type(exc).__name__}: {exc}); "
                                    "install deepspeed to search it") from None
    if not _initialized:
        for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
            os.environ.setdefault(var, value)
        deepspeed.init_distributed()
        _initialized = True
    return deepspeed


def run_offloaded(request: Request, hooks: Hooks, device, card) -> Measured:
    """Runs an offloaded ``request`` through DeepSpeed; raises ``Failed`` for anything that is
    not a fit."""
    knobs = request.knobs
    if device.type != "cuda":
        raise Failed("unsupported", "DeepSpeed ZeRO-Offload needs a CUDA device")
    if knobs.update_in_backward:
        raise Failed("unsupported", "the update in backward does not combine with offload")
    deepspeed = _deepspeed()
    step = Step()
    try:
        return _train(deepspeed, request, hooks, device, card, step)
    except Failed:
        raise
    except Unsupported as exc:
        raise Failed("unsupported", str(exc)) from None
    except MemoryError:
        raise Failed("out_of_memory", "host memory ran out", step.phase, "host") from None
    except Exception as exc:  # noqa: BLE001 - every failure is an outcome
        if is_out_of_memory(exc):
            raise Failed("out_of_memory", str(exc)[:300], step.phase, "gpu") from None
        raise Failed("error", f"{knobs.describe()}: {type(exc).__name__}: {exc}") from None


def _train(deepspeed, request: Request, hooks: Hooks, device, card, step: Step) -> Measured:
    import torch

    knobs = request.knobs
    spec = request.model
    card.start_trial()
    reset_host_peak()
    torch.manual_seed(0)
    model = hooks.build_model(spec)
    if knobs.checkpoint_every is not None:
        if hooks.blocks is None or checkpoint_blocks(hooks.blocks(model), knobs.checkpoint_every) == 0:
            raise Failed("unsupported", "activation checkpointing needs the model's blocks: pass "
                                        "blocks= to autotune_harness.serve")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=deepspeed_config(request))
    gen = torch.Generator(device=device).manual_seed(0)
    batch = hooks.make_batch(spec, knobs.micro_batch, device, gen)
    times = []
    for i in range(request.warmup_steps + request.timed_steps):
        card.synchronize()
        t0 = time.perf_counter()
        for _ in range(knobs.grad_accum):
            step.phase = "forward_backward"
            loss = hooks.loss_fn(engine, batch)
            engine.backward(loss)
            # DeepSpeed counts micro-batches and updates at the accumulation boundary.
            step.phase = "optimizer_step"
            engine.step()
        card.synchronize()
        if i >= request.warmup_steps:
            times.append(time.perf_counter() - t0)
    step.phase = "eval"
    engine.eval()
    with torch.no_grad():
        hooks.loss_fn(engine, batch)
    engine.train()
    card.synchronize()
    return Measured(times, card.peak(), host_peak())
