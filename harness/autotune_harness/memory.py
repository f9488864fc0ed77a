"""Memory: the emulated card, the peaks a trial reports, and what counts as out of memory.

A smaller card is emulated on a larger one with ``torch.cuda.set_per_process_memory_fraction``:
PyTorch's caching allocator then fails at the target's capacity less what lives outside the
allocator (the CUDA context, library handles), which is measured once, in this process, after
the first cuBLAS calls: the device's used memory less what the allocator holds. On a GPU that
other processes use too, their memory counts as well (the emulation errs small);
``AUTOTUNE_HARNESS_CONTEXT_BYTES`` sets the outside part instead (benchmarks set it to match a
reference's fixed cap). The GPU peak a trial reports is what counts against the card: the
allocator's reserved high-water mark (``torch.cuda.max_memory_reserved``, not the smaller
allocated one: reserved memory is what the card must hold) plus that outside part. The host
peak is the process's resident high-water mark (``VmHWM``), reset before each trial where Linux
allows it. The allocator runs as ``PYTORCH_CUDA_ALLOC_CONF`` says, which autotune sets for the
runner (expandable segments by default; docs/trial-protocol.md, *The allocator*).
"""

from __future__ import annotations

import os
import resource
from typing import Optional


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a device allocation failure (PyTorch's, or cuBLAS's/cuDNN's, which
    arrive as plain RuntimeErrors)."""
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and (
        "out of memory" in message.lower() or "ALLOC_FAILED" in message)


class Card:
    """The CUDA device of this process, capped at an emulated capacity."""

    def __init__(self):
        import torch

        self.torch = torch
        self.device = torch.device("cuda", 0)
        self.capacity: Optional[int] = None
        # Bytes the device holds for this process outside the caching allocator.
        self.outside = 0
        self.baseline_allocated = 0
        self.name = torch.cuda.get_device_name(self.device)
        self.total = torch.cuda.get_device_properties(self.device).total_memory
        # The first matrix products create cuBLAS's and cuBLASLt's handles and workspaces, which
        # stay allocated for the process: made here, they are in every trial's baseline alike,
        # in a fresh process as in one that served trials before.
        import torch.nn.functional as F

        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.ones(64, 64, device=self.device, dtype=dtype)
            (x @ x).sum().item()
            F.linear(x, x, x[0]).sum().item()
            del x
        torch.cuda.synchronize(self.device)
        _clear_cublas_workspaces(torch)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        override = os.environ.get("AUTOTUNE_HARNESS_CONTEXT_BYTES")
        if override:
            self.outside = int(override)
        else:
            self.outside = max(0, total - free - torch.cuda.memory_reserved(self.device))
        self.baseline_allocated = torch.cuda.memory_allocated(self.device)

    def emulate(self, capacity: Optional[int]) -> None:
        """Caps the allocator so that allocations beyond ``capacity`` (the whole card, counted
        with what lives outside the allocator) fail as out of memory."""
        if capacity == self.capacity:
            return
        usable = self.total if capacity is None else min(capacity, self.total)
        fraction = (usable - self.outside) / self.total
        if fraction <= 0:
            raise ValueError(f"the emulated capacity ({capacity} bytes) is below what this process "
                             f"holds outside PyTorch's allocator ({self.outside} bytes)")
        self.torch.cuda.set_per_process_memory_fraction(min(fraction, 1.0), self.device)
        self.capacity = capacity

    def start_trial(self) -> None:
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.empty_cache()
        self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return self.torch.cuda.max_memory_reserved(self.device) + self.outside

    def leftover(self) -> int:
        """Bytes a finished trial left allocated (0 when the next trial starts clean)."""
        self.torch.cuda.synchronize(self.device)
        _clear_cublas_workspaces(self.torch)
        self.torch.cuda.empty_cache()
        return max(0, self.torch.cuda.memory_allocated(self.device) - self.baseline_allocated)

    def synchronize(self) -> None:
        self.torch.cuda.synchronize(self.device)


def _clear_cublas_workspaces(torch) -> None:
    """Frees cuBLAS's workspaces, which PyTorch allocates from its caching allocator once per
    handle (32 MiB each by default) and keeps: the backward pass's thread has a handle of its
    own, so without this every trial would look as if it left 32 MiB behind."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def reset_host_peak() -> bool:
    """Resets this process's resident high-water mark; False where Linux does not allow it (the
    peak then counts since the process started)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def host_peak() -> int:
    """This process's resident high-water mark in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
