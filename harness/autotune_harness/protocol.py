"""The runner's side of autotune's trial protocol (docs/trial-protocol.md): requests in, one
reply line out. Python standard library only.

autotune writes one request per line on the runner's stdin; the runner answers each with one
JSON line on stdout that carries ``"protocol": 2`` and echoes the request's ``id``, so that
autotune never takes a reply for another request's (a request without an id, from an older
autotune, is answered in protocol 1, without one). Anything else the runner (or a library it
uses) prints on stdout is skipped by autotune, so printing is safe; only the reply must be one
line and flushed.
"""

from __future__ import annotations

import json
import sys
from typing import Iterator, Optional, TextIO

# The version of replies that echo their request's id.
PROTOCOL = 2
# The version requests say they are: a version-2 request is a version-1 request with an id.
REQUEST_PROTOCOL = 1

PHASES = ("setup", "forward_backward", "optimizer_step", "eval", "checkpoint")


class Knobs:
    """The setting a request asks for, read from its ``knobs`` object."""

    def __init__(self, knobs: dict):
        self.micro_batch = int(knobs["micro_batch"])
        self.grad_accum = int(knobs["grad_accum"])
        self.precision = knobs["precision"]
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"unknown precision {self.precision!r}")
        checkpointing = knobs.get("checkpointing", {"mode": "none"})
        mode = checkpointing.get("mode")
        if mode == "none":
            self.checkpoint_every: Optional[int] = None
        elif mode == "every_kth" and int(checkpointing.get("k", 0)) >= 1:
            self.checkpoint_every = int(checkpointing["k"])
        else:
            raise ValueError(f"unknown checkpointing {checkpointing!r}")
        self.offload = knobs.get("offload", "none") == "optimizer"
        self.update_in_backward = knobs.get("update", "after_backward") == "in_backward"
        self.data_parallel = int(knobs.get("data_parallel", {}).get("degree", 1))

    def describe(self) -> str:
        ckpt = "none" if self.checkpoint_every is None else (
            "all" if self.checkpoint_every == 1 else f"every-{self.checkpoint_every}")
        text = (f"mb={self.micro_batch} accum={self.grad_accum} {self.precision} ckpt={ckpt} "
                f"offload={'optimizer' if self.offload else 'none'}")
        return text + (" update=in-backward" if self.update_in_backward else "")


class Request:
    """One trial request: the model spec, the knobs, the trial's length and the limits."""

    def __init__(self, message: dict):
        self.raw = message
        self.protocol = message.get("protocol")
        self.model: dict = message["model"]
        self.knobs = Knobs(message["knobs"])
        self.warmup_steps = int(message["warmup_steps"])
        self.timed_steps = int(message["timed_steps"])
        self.device: str = message["device"]
        self.gpu_capacity_bytes: Optional[int] = message.get("gpu_capacity_bytes")
        self.host_budget_bytes: Optional[int] = message.get("host_budget_bytes")

    @property
    def seq_len(self) -> int:
        return int(self.model["seq_len"])


def requests(stream: TextIO = sys.stdin) -> Iterator[dict]:
    """The request objects on ``stream``, one per line, until its end. A line that is not a
    JSON object is yielded as ``{"unreadable": line}`` so the caller answers it with an error."""
    for line in stream:
        line = line.strip()
        if not line:
            continue
        try:
            message = json.loads(line)
        except json.JSONDecodeError as e:
            yield {"unreadable": f"{e}: {line[:200]}"}
            continue
        yield message if isinstance(message, dict) else {"unreadable": line[:200]}


class Replier:
    """Writes replies: who answers (engine, version, device) is filled in for every one."""

    def __init__(self, engine: str, engine_version: Optional[str] = None,
                 out: TextIO = sys.stdout):
        self.engine = engine
        self.engine_version = engine_version
        self.device: Optional[str] = None
        self.out = out
        self.request_id: Optional[int] = None

    def answering(self, message: dict) -> None:
        """Makes the next replies answer ``message``: they echo its ``id``."""
        request_id = message.get("id")
        valid = isinstance(request_id, int) and not isinstance(request_id, bool)
        self.request_id = request_id if valid and request_id >= 0 else None

    def _send(self, outcome: str, reusable: bool, **fields) -> dict:
        message = {"protocol": 1, "outcome": outcome, "engine": self.engine,
                   "reusable": bool(reusable)}
        if self.request_id is not None:
            message.update(protocol=PROTOCOL, id=self.request_id)
        if self.engine_version:
            message["engine_version"] = self.engine_version
        if self.device:
            message["device"] = self.device
        message.update(fields)
        # One line, flushed: autotune reads it at once.
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()
        return message

    def fits(self, step_times_s, peak_gpu_bytes: int, peak_host_bytes: int,
             reusable: bool = True, tokens_per_s: Optional[float] = None) -> dict:
        fields = {"step_times_s": [float(t) for t in step_times_s],
                  "peak_gpu_bytes": int(peak_gpu_bytes), "peak_host_bytes": int(peak_host_bytes)}
        if tokens_per_s is not None:
            fields["tokens_per_s"] = float(tokens_per_s)
        return self._send("fits", reusable, **fields)

    def out_of_memory(self, memory: str, phase: str, reusable: bool = True) -> dict:
        assert memory in ("gpu", "host") and phase in PHASES, (memory, phase)
        return self._send("out_of_memory", reusable, memory=memory, phase=phase)

    def error(self, reason: str, reusable: bool = False) -> dict:
        return self._send("error", reusable, reason=str(reason)[:1000])

    def unsupported(self, reason: str, reusable: bool = True) -> dict:
        return self._send("unsupported", reusable, reason=str(reason)[:1000])
