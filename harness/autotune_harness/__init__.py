"""autotune_harness: make a PyTorch training setup a trial runner for ``autotune tune --backend
exec`` (docs/trial-protocol.md), so that plans are measured in PyTorch itself.

A runner script wraps a model factory and a batch function::

    from autotune_harness import serve

    def build_model(spec):                     # spec: the model spec autotune tunes (a dict)
        return MyTransformer(spec["d_model"], spec["n_layers"], ...)

    def make_batch(spec, micro_batch, device, generator):
        x = torch.randint(0, spec["vocab_size"], (micro_batch, spec["seq_len"]),
                          device=device, generator=generator)
        return x, torch.roll(x, -1, dims=1)    # whatever loss_fn takes

    if __name__ == "__main__":
        raise SystemExit(serve(build_model, make_batch, blocks=lambda m: m.blocks))

and is run by autotune::

    autotune tune --model gpt-124m --target rtx4090-32g --backend exec -- python3 runner.py

``serve`` reads trial requests from stdin and answers each with one JSON line on stdout, until
its input ends. Each trial builds a fresh model and optimizer and trains ``warmup_steps +
timed_steps`` steps at the requested knobs (see ``trial.py`` and ``offload.py``): micro-batch
and accumulation; bf16/fp16 autocast with a GradScaler for fp16; ``torch.utils.checkpoint`` on
every k-th of the modules ``blocks(model)`` returns; DeepSpeed ZeRO-Offload for optimizer
offload (imported only then); the update in backward if asked. On a GPU the target card is
emulated (``memory.py``) and the reply's peak is ``max_memory_reserved`` plus the memory outside
PyTorch's allocator; on a CPU it is the host's resident peak and no device memory. An
out-of-memory (or a host peak above the budget) is answered as such, any other failure as an
error: the search goes on either way.

Optional hooks: ``loss_fn(model, batch)`` (default: cross-entropy of ``model(inputs)`` against
``targets``), ``build_optimizer(params, spec)`` (default: the spec's Adam or AdamW). A hook that
cannot build what the spec asks for at any batch size raises ``Unsupported``: the regime is
answered as such, and autotune asks no more of it.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterable, Optional, TextIO

from .protocol import PROTOCOL, REQUEST_PROTOCOL, Replier, Request, requests
from .trial import Failed, Hooks, Unsupported, default_loss, default_optimizer

__all__ = ["serve", "Unsupported", "PROTOCOL", "default_loss", "default_optimizer"]

ENGINE = "pytorch"


def log(message: str) -> None:
    print(f"autotune_harness: {message}", file=sys.stderr, flush=True)


class _Runner:
    """The state a runner process keeps between trials: the device and its emulation."""

    def __init__(self, hooks: Hooks, replier: Replier):
        self.hooks = hooks
        self.replier = replier
        self.card = None
        self.torch = None

    def answer(self, message: dict) -> bool:
        """Answers one request; returns whether this process may serve the next."""
        r = self.replier
        if "unreadable" in message:
            r.error(f"the request is not a JSON object: {message['unreadable']}", reusable=True)
            return True
        if message.get("protocol") != REQUEST_PROTOCOL:
            r.error(f"this harness reads requests of trial protocol {REQUEST_PROTOCOL}, the "
                    f"request is {message.get('protocol')!r}", reusable=False)
            return False
        try:
            request = Request(message)
        except (KeyError, TypeError, ValueError) as exc:
            r.error(f"the request cannot be read: {type(exc).__name__}: {exc}", reusable=True)
            return True
        knobs = request.knobs
        if knobs.data_parallel > 1:
            r.unsupported("a harness runner trains on one GPU", reusable=True)
            return True
        try:
            device = self._device(request)
        except Failed as failed:
            r.unsupported(failed.detail, reusable=False)
            return False
        from .offload import run_offloaded
        from .trial import release, run_plain

        run = run_offloaded if knobs.offload else run_plain
        outcome = None
        try:
            measured = run(request, self.hooks, device, self.card)
        except Failed as failed:
            outcome = (failed.kind, failed.detail, failed.phase, failed.memory)
            measured = None
        # Out of the handler: the failed trial's frames, and their tensors, are gone now.
        leftover = release(self.card)
        # DeepSpeed keeps state in its process: a fresh one after each trial it ran.
        ran_deepspeed = knobs.offload and (outcome is None or outcome[0] != "unsupported")
        reusable = leftover == 0 and not ran_deepspeed
        what = f"{request.model.get('name', 'model')} {knobs.describe()}"
        if leftover:
            log(f"{what}: {leftover} bytes stayed allocated after the trial; a fresh process next")
        if measured is not None:
            budget = request.host_budget_bytes
            if budget is not None and measured.peak_host_bytes > budget:
                log(f"{what}: host peak {measured.peak_host_bytes} above the budget {budget}")
                r.out_of_memory("host", "forward_backward", reusable=reusable)
                return reusable
            times = sorted(measured.step_times_s)
            median = times[len(times) // 2] if times else 0.0
            log(f"{what}: fits, {median * 1e3:.1f} ms/step, peak GPU "
                f"{measured.peak_gpu_bytes / 2**30:.2f} GiB, host {measured.peak_host_bytes / 2**30:.2f} GiB")
            r.fits(measured.step_times_s, measured.peak_gpu_bytes, measured.peak_host_bytes,
                   reusable=reusable)
            return reusable
        kind, detail, phase, memory = outcome
        log(f"{what}: {kind}: {detail[:300]}")
        if kind == "out_of_memory":
            r.out_of_memory(memory, phase, reusable=reusable)
        elif kind == "unsupported":
            r.unsupported(detail, reusable=reusable)
        else:
            # A failed trial may leave CUDA in an error state: a fresh process follows.
            reusable = False
            r.error(detail, reusable=False)
        return reusable

    def _device(self, request: Request):
        import torch

        self.torch = torch
        if request.device == "cpu":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise Failed("unsupported", "the request is for a CUDA device, but PyTorch here sees "
                                        "none")
        if self.card is None:
            from .memory import Card

            self.card = Card()
            self.replier.device = self.card.name
            log(f"{self.card.name}: {self.card.total / 2**30:.1f} GiB, "
                f"{self.card.outside / 2**20:.0f} MiB outside PyTorch's allocator")
        try:
            self.card.emulate(request.gpu_capacity_bytes)
        except ValueError as exc:
            raise Failed("unsupported", str(exc)) from None
        return self.card.device


def serve(build_model: Callable[[dict], Any], make_batch: Callable[..., Any], *,
          blocks: Optional[Callable[[Any], Iterable[Any]]] = None,
          loss_fn: Optional[Callable[[Any, Any], Any]] = None,
          build_optimizer: Optional[Callable[[Iterable[Any], dict], Any]] = None,
          stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    """Answers autotune's trial requests on ``stdin`` until it ends (or until this process
    should not serve another trial); returns the exit code."""
    if stdin.isatty():
        log("this is a trial runner: autotune starts it, e.g. `autotune tune --backend exec -- "
            "python3 RUNNER.py`; it reads trial requests (docs/trial-protocol.md) on stdin")
        return 2
    try:
        import torch

        version = torch.__version__
    except Exception as exc:  # noqa: BLE001 - answered, so the search says why
        version = None
        torch_missing = f"PyTorch is not importable here ({type(exc).__name__}: {exc})"
    else:
        torch_missing = None
    replier = Replier(ENGINE, version, stdout)
    runner = _Runner(Hooks(build_model, make_batch, blocks, loss_fn, build_optimizer), replier)
    for message in requests(stdin):
        replier.answering(message)
        if torch_missing is not None:
            replier.unsupported(torch_missing, reusable=True)
            continue
        if not runner.answer(message):
            return 0
    return 0
