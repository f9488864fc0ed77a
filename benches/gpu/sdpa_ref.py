#!/usr/bin/env python3
"""PyTorch's attention at the flash-attention shapes of benches/cuda_timings.rs.

Times torch.nn.functional.scaled_dot_product_attention forward and backward in bf16 at the
shapes (and with the causal mask and dropout) of the `flash` lines of the cuda_timings bench and
prints one line per shape in the same format, `sdpa` in place of `flash`, so that the two can be
put side by side:

    python3 benches/gpu/sdpa_ref.py                    # every shape, PyTorch's choice of kernel
    python3 benches/gpu/sdpa_ref.py --shapes gpt-1.3b  # the shapes whose name contains this
    python3 benches/gpu/sdpa_ref.py --backend flash    # one backend: flash, efficient, cudnn, math

The inputs are laid out as a GPT's q/k/v product is: one (batch, seq, 3, heads, hd) tensor whose
q, k and v are (batch, heads, seq, hd) views, as autotune's kernels read them from the
(batch·seq, 3·d) rows. The forward pass runs with gradients on (it keeps what the backward pass
needs, as a training step's does); the backward pass is torch.autograd.grad of the output with
respect to q, k and v, which runs the attention backward kernel alone. Each time is the median of
--reps runs after --warmup runs (the upper median, as the bench takes it), measured with CUDA
events around each run. TFLOP/s count the useful products only, as the bench does: forward
4·b·h·s²·hd, backward 2.5 times that, half of each when causal.

Which kernel PyTorch picked (its autograd node) and the torch version go to stderr.
Needs only torch (a CUDA build) and the standard library.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

# (name, batch, seq, heads, head width, causal, dropout p): the bench's flash shapes.
SHAPES = [
    ("seed b512", 512, 128, 8, 64, False, 0.1),
    ("gpt-124m b16", 16, 1024, 12, 64, True, 0.0),
    ("gpt-1.3b b1", 1, 1024, 16, 128, True, 0.0),
    ("gpt-1.3b b2", 2, 1024, 16, 128, True, 0.0),
    ("gpt-1.3b b8", 8, 1024, 16, 128, True, 0.0),
]


def median_ms(f, reps: int, warmup: int) -> float:
    """The upper median of `reps` CUDA-event timings of `f` in milliseconds, after warm-ups."""
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[reps // 2]


def time_shape(name, batch, seq, heads, hd, causal, p, reps, warmup):
    dtype = torch.bfloat16
    qkv = torch.randn(batch, seq, 3, heads, hd, device="cuda", dtype=dtype, requires_grad=True)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    dout = torch.randn(batch, heads, seq, hd, device="cuda", dtype=dtype)

    def forward():
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)

    out = forward()
    print(f"sdpa_ref.py: {name}: {out.grad_fn.name()}", file=sys.stderr)
    fwd = median_ms(forward, reps, warmup)
    bwd = median_ms(
        lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), reps, warmup
    )
    flops = 4.0 * batch * heads * seq * seq * hd * (0.5 if causal else 1.0)
    print(
        f"sdpa {name} bf16 (s {seq}, h {heads}, hd {hd}, causal {str(causal).lower()}, "
        f"dropout {str(p > 0).lower()}): forward {fwd:.3f} ms ({flops / fwd / 1e9:.0f} TFLOP/s), "
        f"backward {bwd:.3f} ms ({2.5 * flops / bwd / 1e9:.0f} TFLOP/s)",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="", help="only the shapes whose name contains this")
    parser.add_argument(
        "--backend",
        choices=["flash", "efficient", "cudnn", "math"],
        help="force one SDPA backend (default: PyTorch's choice)",
    )
    parser.add_argument("--reps", type=int, default=20, help="timed runs per measurement")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before them")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sdpa_ref.py: needs a CUDA device", file=sys.stderr)
        return 1
    print(
        f"sdpa_ref.py: torch {torch.__version__} (CUDA {torch.version.cuda}) on "
        f"{torch.cuda.get_device_name()}",
        file=sys.stderr,
    )
    shapes = [s for s in SHAPES if args.shapes in s[0]]
    if args.backend:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH,
        }[args.backend]
        with sdpa_kernel(backend):
            for shape in shapes:
                time_shape(*shape, args.reps, args.warmup)
    else:
        for shape in shapes:
            time_shape(*shape, args.reps, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
