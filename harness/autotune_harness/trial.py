"""One trial in plain PyTorch: the user's model and batches, trained at the requested knobs.

The step honours every knob autotune searches (except optimizer offload, see ``offload.py``):
``grad_accum`` micro-batches of ``micro_batch`` sequences per optimizer step; bf16 or fp16
``torch.autocast`` over fp32 master weights, with a ``GradScaler`` for fp16; every k-th block
recomputed in backward through ``torch.utils.checkpoint``; the update in backward through
per-parameter optimizers stepped from ``register_post_accumulate_grad_hook``; gradient clipping
when the model spec asks for it. Each step is timed between device synchronisations; after
the timed steps an evaluation pass (no gradients) runs at the same micro-batch, because that
path can run out of memory where training did not.
"""

from __future__ import annotations

import functools
import gc
import time
from typing import Any, Callable, Iterable, Optional

from .memory import host_peak, is_out_of_memory, reset_host_peak
from .protocol import Request

DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


class Hooks:
    """What a runner tells the harness about its model (see ``autotune_harness.serve``)."""

    def __init__(self, build_model: Callable[[dict], Any], make_batch: Callable[..., Any],
                 blocks: Optional[Callable[[Any], Iterable[Any]]] = None,
                 loss_fn: Optional[Callable[[Any, Any], Any]] = None,
                 build_optimizer: Optional[Callable[[Iterable[Any], dict], Any]] = None):
        self.build_model = build_model
        self.make_batch = make_batch
        self.blocks = blocks
        self.loss_fn = loss_fn or default_loss
        self.build_optimizer = build_optimizer or default_optimizer


def default_loss(model, batch):
    """Cross-entropy of ``model(inputs)`` against ``targets`` for ``batch = (inputs, targets)``,
    in fp32 (as autocast computes it)."""
    import torch.nn.functional as F

    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def default_optimizer(params, spec: dict):
    """The model spec's Adam or AdamW (fused on a GPU)."""
    import torch

    params = list(params)
    o = spec.get("optimizer", {})
    kind = torch.optim.AdamW if o.get("kind", "adamw") == "adamw" else torch.optim.Adam
    return kind(params, lr=o.get("lr", 1e-3), betas=(o.get("beta1", 0.9), o.get("beta2", 0.999)),
                eps=o.get("eps", 1e-8), weight_decay=o.get("weight_decay", 0.0),
                fused=bool(params) and params[0].is_cuda)


def checkpoint_blocks(blocks: Iterable[Any], every: int) -> int:
    """Makes every ``every``-th of ``blocks`` (0, k, 2k, ...) recompute its activations in
    backward; returns how many it wrapped."""
    from torch.utils.checkpoint import checkpoint

    wrapped = 0
    for i, block in enumerate(blocks):
        if i % every:
            continue
        forward = block.forward

        @functools.wraps(forward)
        def recomputed(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = recomputed
        wrapped += 1
    return wrapped


class Unsupported(Exception):
    """Raised by a runner's hooks for a setting or model they cannot run at any batch size (a
    spec of another architecture, a missing library): the regime is answered ``unsupported``
    and autotune asks no more of it."""


class Failed(Exception):
    """A trial that ended in an outcome other than a fit: ``kind`` is out_of_memory, error or
    unsupported."""

    def __init__(self, kind: str, detail: str, phase: str = "forward_backward",
                 memory: str = "gpu"):
        super().__init__(detail)
        self.kind, self.detail, self.phase, self.memory = kind, detail, phase, memory


class Measured:
    """What a fitting trial measured."""

    def __init__(self, step_times_s, peak_gpu_bytes: int, peak_host_bytes: int):
        self.step_times_s = step_times_s
        self.peak_gpu_bytes = peak_gpu_bytes
        self.peak_host_bytes = peak_host_bytes


class Step:
    """Where the trial is, so that an out-of-memory names its phase."""

    def __init__(self):
        self.phase = "setup"


def autocast(torch, device, precision: str):
    dtype = DTYPES[precision]
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def run_plain(request: Request, hooks: Hooks, device, card) -> Measured:
    """Runs ``request`` in this process without offload; raises ``Failed`` for anything that is
    not a fit. Everything the trial allocates lives in this frame and is freed when it returns."""
    import torch

    knobs = request.knobs
    step = Step()
    try:
        return _train(torch, request, hooks, device, card, step)
    except Failed:
        raise
    except Unsupported as exc:
        raise Failed("unsupported", str(exc)) from None
    except MemoryError:
        raise Failed("out_of_memory", "host memory ran out", step.phase, "host") from None
    except Exception as exc:  # noqa: BLE001 - every failure is an outcome
        if device.type == "cuda" and is_out_of_memory(exc):
            raise Failed("out_of_memory", str(exc)[:300], step.phase, "gpu") from None
        raise Failed("error", f"{knobs.describe()}: {type(exc).__name__}: {exc}") from None


def _train(torch, request: Request, hooks: Hooks, device, card, step: Step) -> Measured:
    knobs = request.knobs
    spec = request.model
    if card is not None:
        card.start_trial()
    reset_host_peak()
    torch.manual_seed(0)
    # Built on the device: initialising a large model on the host first would cost seconds.
    with device:
        model = hooks.build_model(spec).to(device)
    model.train()
    if knobs.checkpoint_every is not None:
        if hooks.blocks is None:
            raise Failed("unsupported", "activation checkpointing needs the model's blocks: pass "
                                        "blocks= to autotune_harness.serve")
        if checkpoint_blocks(hooks.blocks(model), knobs.checkpoint_every) == 0:
            raise Failed("unsupported", "activation checkpointing: blocks= gave no modules")
    params = [p for p in model.parameters() if p.requires_grad]
    clip = spec.get("optimizer", {}).get("grad_clip")
    scaler = torch.amp.GradScaler(device.type) if knobs.precision == "fp16" else None
    if knobs.update_in_backward:
        if scaler is not None or knobs.grad_accum > 1 or clip:
            raise Failed("unsupported", "the update in backward needs no fp16, accumulation or "
                                        "clipping")
        per_param = {p: hooks.build_optimizer([p], spec) for p in params}

        def update(p):
            per_param[p].step()
            per_param[p].zero_grad(set_to_none=True)

        for p in params:
            p.register_post_accumulate_grad_hook(update)
        optimizer = None
    else:
        optimizer = hooks.build_optimizer(params, spec)
    gen = torch.Generator(device=device).manual_seed(0)
    batch = hooks.make_batch(spec, knobs.micro_batch, device, gen)

    def sync():
        if card is not None:
            card.synchronize()

    times = []
    for i in range(request.warmup_steps + request.timed_steps):
        sync()
        t0 = time.perf_counter()
        step.phase = "forward_backward"
        for _ in range(knobs.grad_accum):
            with autocast(torch, device, knobs.precision):
                loss = hooks.loss_fn(model, batch)
            loss = loss / knobs.grad_accum
            (scaler.scale(loss) if scaler is not None else loss).backward()
        step.phase = "optimizer_step"
        if optimizer is not None:
            if clip:
                if scaler is not None:
                    scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, clip)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync()
        if i >= request.warmup_steps:
            times.append(time.perf_counter() - t0)
    step.phase = "eval"
    model.eval()
    with torch.no_grad(), autocast(torch, device, knobs.precision):
        hooks.loss_fn(model, batch)
    model.train()
    sync()
    peak_gpu = card.peak() if card is not None else 0
    return Measured(times, peak_gpu, host_peak())


def release(card) -> int:
    """Frees what the last trial left and returns the device bytes still allocated by it."""
    gc.collect()
    return card.leftover() if card is not None else 0
