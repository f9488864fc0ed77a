#!/usr/bin/env python3
"""Step-time floor of optimizer offload, next to measured step times.

    python3 offload_floor.py [--pcie-gbs 25] [--host-gbs 40] OUT/regimes.jsonl ... > floor.md
    python3 offload_floor.py --params 1.3e9 [--grad-accum 1] [--precision bf16] [...]

With offload, every optimizer step moves data that no kernel speed-up can avoid:

- PCIe: each micro-batch's gradients come down in the compute dtype (autotune copies and
  sums them in f32 on the host per micro-batch), and the updated working copies go up
  once: P * b * (grad_accum + 1) bytes, b = 2 for bf16/f16 and 4 for fp32 (bf16 with one
  micro-batch: 4 B/param). The copies are synchronous, so down and up add up.
- Host memory: summing the gradients (first micro-batch: read b + write 4 B/param; each
  further one: read b + read/write 8), the fused Adam pass (read master, m, v, grad = 16,
  write master, m, v = 12, plus the 2-byte working copy at bf16/f16) and, at fp16 only,
  unscaling (8).

floor = PCIe bytes / PCIe bandwidth + host bytes / host memory bandwidth. Both bandwidths
are arguments, not measurements: 25 GB/s is PCIe 4.0 x16 (RTX 4090 hosts measure 24-27
GB/s pinned; pageable copies, which candle uses, are slower), and the host figure is what
all cores together stream on the machine in question. The floor ignores the 4-byte
vectors (biases, norms), a negligible share of the parameters.

Input lines are the JSON objects `autotune probe --json` prints; non-JSON lines are
skipped, and for a repeated (model, micro-batch, regime) the last line wins. Standard
library only.
"""

from __future__ import annotations

import argparse
import json
import sys

GIB = 2**30
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def floor_s(params: float, precision: str, grad_accum: int, pcie_gbs: float, host_gbs: float):
    """Returns (floor seconds, PCIe bytes, host bytes) of one offloaded optimizer step."""
    b = BYTES[precision]
    pcie = params * b * (grad_accum + 1)
    accumulate = (b + 4) + (grad_accum - 1) * (b + 8)
    update = 28 + (2 if b == 2 else 0)
    unscale = 8 if precision == "fp16" else 0
    host = params * (accumulate + update + unscale)
    return pcie / (pcie_gbs * 1e9) + host / (host_gbs * 1e9), pcie, host


def regime_of(rec: dict) -> tuple[str, str, int]:
    """(checkpointing, offload, grad_accum) of a probe line or of a failed run's stand-in."""
    knobs = (rec.get("request") or {}).get("knobs")
    if knobs is None:
        return str(rec.get("checkpointing", "?")), str(rec.get("offload", "?")), 1
    ckpt = knobs.get("checkpointing", {"mode": "none"})
    if ckpt.get("mode") == "none":
        name = "none"
    elif ckpt.get("k") == 1:
        name = "all"
    else:
        name = f"every-{ckpt.get('k')}"
    return name, knobs.get("offload", "none"), int(knobs.get("grad_accum", 1))


def load(paths: list[str]) -> dict:
    rows: dict = {}
    for path in paths:
        try:
            f = open(path, encoding="utf-8", errors="replace")
        except OSError as e:
            print(f"offload_floor.py: skipping {path}: {e}", file=sys.stderr)
            continue
        with f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                ckpt, offload, accum = regime_of(rec)
                key = (rec.get("model"), rec.get("precision"), rec.get("micro_batch"), accum, ckpt, offload)
                rows[key] = rec
    return rows


def fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def table(rows: dict, pcie_gbs: float, host_gbs: float) -> str:
    out = [
        f"Offload floor at PCIe {pcie_gbs:g} GB/s and host memory {host_gbs:g} GB/s "
        "(see offload_floor.py for what it counts).",
        "",
        "| model | params (M) | precision | micro-batch | accum | checkpointing | offload | outcome "
        "| ms/step | peak GPU GiB | peak host GiB | floor ms | floor ÷ measured | offload cost ms |",
        "|---|--:|---|--:|--:|---|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for key in sorted(rows, key=lambda k: tuple(str(x) for x in k)):
        model, precision, mb, accum, ckpt, offload = key
        rec = rows[key]
        measured = rec.get("step_time_median_s")
        params = rec.get("params")
        floor = share = cost = None
        if offload == "optimizer" and params and precision in BYTES:
            floor, _, _ = floor_s(params, precision, accum, pcie_gbs, host_gbs)
            if measured:
                share = floor / measured
            twin = rows.get((model, precision, mb, accum, ckpt, "none"), {})
            if measured and twin.get("step_time_median_s"):
                cost = (measured - twin["step_time_median_s"]) * 1e3
        gpu, host = rec.get("peak_gpu_bytes"), rec.get("peak_host_bytes")
        outcome = rec.get("outcome", "?")
        if outcome == "out_of_memory":
            outcome = f"oom ({rec.get('memory', '?')}, {rec.get('phase', '?')})"
        out.append(
            f"| {model} | {fmt(params and params / 1e6, '.1f')} | {precision} | {mb} | {accum} | {ckpt} "
            f"| {offload} | {outcome} | {fmt(measured and measured * 1e3, '.1f')} "
            f"| {fmt(gpu and gpu / GIB, '.2f')} | {fmt(host and host / GIB, '.2f')} "
            f"| {fmt(floor and floor * 1e3, '.1f')} | {fmt(share, '.2f')} | {fmt(cost, '.1f')} |"
        )
    out += [
        "",
        "floor ÷ measured near 1 means the offloaded step is bound by data movement; "
        "offload cost is the measured step minus the same setting without offload.",
    ]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("jsonl", nargs="*", help="probe JSON lines (regimes.jsonl)")
    p.add_argument("--pcie-gbs", type=float, default=25.0, help="host<->GPU GB/s (default 25)")
    p.add_argument("--host-gbs", type=float, default=40.0, help="host memory GB/s (default 40)")
    p.add_argument("--params", type=float, help="print the floor for this many parameters instead")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--precision", choices=sorted(BYTES), default="bf16")
    args = p.parse_args()
    if args.pcie_gbs <= 0 or args.host_gbs <= 0 or args.grad_accum < 1:
        p.error("bandwidths must be positive and --grad-accum at least 1")
    if args.params is not None:
        floor, pcie, host = floor_s(args.params, args.precision, args.grad_accum, args.pcie_gbs, args.host_gbs)
        print(
            f"{args.params / 1e6:.1f} M params, {args.precision}, grad_accum {args.grad_accum}: "
            f"PCIe {pcie / 1e9:.2f} GB, host {host / 1e9:.2f} GB, floor {floor * 1e3:.1f} ms/step"
        )
        return 0
    if not args.jsonl:
        p.error("give JSON-lines files or --params")
    print(table(load(args.jsonl), args.pcie_gbs, args.host_gbs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
