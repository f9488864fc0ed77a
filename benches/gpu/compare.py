#!/usr/bin/env python3
"""Put autotune and PyTorch benchmark results side by side as a Markdown table.

    python3 compare.py OUT/autotune.jsonl OUT/pytorch.jsonl > OUT/table.md

Each input line is one JSON object as printed by `autotune probe --json`
("impl": "autotune") or by torch_ref.py ("impl": "pytorch"). Lines that are not
JSON objects (log noise, partial writes) are skipped. When a (impl, model,
precision, micro_batch) appears more than once, the last line wins, so re-runs
can simply be appended. Standard library only, so it runs anywhere.
"""

from __future__ import annotations

import json
import math
import sys

GIB = 2**30
PRECISION_ORDER = {"fp32": 0, "bf16": 1, "fp16": 2}
# Step times whose p10..p90 range exceeds this share of the median get flagged:
# the medians are still reported, but such rows deserve a second run.
NOISY_SPREAD = 0.10


def load(paths: list[str]) -> tuple[dict, list]:
    """Returns {(model, precision, micro_batch): {impl: record}} and model order."""
    rows: dict = {}
    model_order: list = []
    for path in paths:
        try:
            f = open(path, encoding="utf-8", errors="replace")
        except OSError as e:
            print(f"compare.py: skipping {path}: {e}", file=sys.stderr)
            continue
        with f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(r, dict):
                    continue
                try:
                    key = (str(r["model"]), str(r["precision"]), int(r["micro_batch"]))
                    impl = str(r["impl"])
                except (KeyError, TypeError, ValueError):
                    continue
                rows.setdefault(key, {})[impl] = r
                if key[0] not in model_order:
                    model_order.append(key[0])
    return rows, model_order


def num(r: dict | None, field: str) -> float | None:
    """A finite number from a record that fitted, else None."""
    if not r or r.get("outcome") != "fits":
        return None
    v = r.get(field)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return float(v)
    return None


def cell(r: dict | None, field: str, fmt) -> str:
    if r is None:
        return "–"
    outcome = r.get("outcome")
    if outcome == "out_of_memory":
        return "OOM"
    if outcome != "fits":
        return str(outcome or "?")  # e.g. "error" or "timeout" recorded by run.sh
    v = num(r, field)
    return "–" if v is None else fmt(v)


def ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None else f"{a / b:.2f}"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv else 2
    # `--ref IMPL` compares against another reference's records (e.g. pytorch-compile).
    ref_impl = "pytorch"
    if argv[0] == "--ref" and len(argv) > 1:
        ref_impl, argv = argv[1], argv[2:]
    rows, model_order = load(argv)
    if not rows:
        print("compare.py: no results found", file=sys.stderr)
        return 1

    def sort_key(k):
        model, precision, mb = k
        return (model_order.index(model), PRECISION_ORDER.get(precision, 99), precision, mb)

    ms = lambda v: f"{v * 1e3:.1f}"          # noqa: E731
    tok = lambda v: f"{v:,.0f}"              # noqa: E731
    gib = lambda v: f"{v / GIB:.2f}"         # noqa: E731

    print("| model | precision | micro-batch | ours ms/step | PyTorch ms/step | ours tokens/s "
          "| PyTorch tokens/s | speed ratio (≥1 = ours faster) | ours peak GiB "
          "| PyTorch peak GiB | memory ratio (ours ÷ PyTorch) |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    speed_ratios = []
    noisy = []
    for key in sorted(rows, key=sort_key):
        ours = rows[key].get("autotune")
        ref = rows[key].get(ref_impl)
        ours_tps, ref_tps = num(ours, "tokens_per_s"), num(ref, "tokens_per_s")
        if ours_tps and ref_tps:
            speed_ratios.append(ours_tps / ref_tps)
        for impl, r in (("ours", ours), ("PyTorch", ref)):
            spread = num(r, "step_time_spread")
            if spread is not None and spread > NOISY_SPREAD:
                noisy.append(f"{'/'.join(map(str, key))} {impl} ({spread:.0%})")
        print("| " + " | ".join([
            key[0], key[1], str(key[2]),
            cell(ours, "step_time_median_s", ms), cell(ref, "step_time_median_s", ms),
            cell(ours, "tokens_per_s", tok), cell(ref, "tokens_per_s", tok),
            ratio(ours_tps, ref_tps),
            cell(ours, "peak_gpu_bytes", gib), cell(ref, "peak_gpu_bytes", gib),
            ratio(num(ours, "peak_gpu_bytes"), num(ref, "peak_gpu_bytes")),
        ]) + " |")

    print()
    print("PyTorch peak is `torch.cuda.max_memory_allocated()` (tensors only, not the caching "
          "allocator's reserve). `–` = no result for that side.")
    if speed_ratios:
        geo = math.exp(sum(math.log(x) for x in speed_ratios) / len(speed_ratios))
        print(f"Speed ratio over the {len(speed_ratios)} rows where both fit: "
              f"geometric mean {geo:.2f}, min {min(speed_ratios):.2f}, max {max(speed_ratios):.2f}.")
    if noisy:
        print(f"Noisy step times (p90−p10 over median > {NOISY_SPREAD:.0%}): {', '.join(noisy)}.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
