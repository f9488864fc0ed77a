#!/usr/bin/env python3
"""Summarise fp8_bench.sh's folder: gpt-1.3b's tokens/s in fp8 against bf16 (the slower round of
each, so a lucky round flatters neither), and gpt-124m's loss after its steps in fp8 against
bf16 (the mean of the last 20 steps' losses, which one step's noise does not swing).

    python3 fp8_report.py OUTDIR > OUTDIR/summary.md

Writes OUTDIR/headline.json with "gpt-1.3b fp8 tokens/s vs bf16" and "gpt-124m fp8 loss after
N steps vs bf16" (without the folder and commit, which the caller adds). Standard library only.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import GIB, lines  # noqa: E402

TAIL = 20


def slowest(rows: list[dict], precision: str) -> dict | None:
    """The slowest fitting round of `precision`."""
    fitting = [r for r in rows if r.get("precision") == precision and r.get("outcome") == "fits"
               and isinstance(r.get("tokens_per_s"), (int, float))]
    return min(fitting, key=lambda r: r["tokens_per_s"], default=None)


def tail_loss(rows: list[dict]) -> tuple[float, int] | None:
    """The mean loss of the last TAIL steps, and the steps run."""
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
    if len(losses) < TAIL:
        return None
    return sum(losses[-TAIL:]) / TAIL, len(losses)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = pathlib.Path(argv[1])
    env = (out / "env.txt").read_text(errors="replace").strip() if (out / "env.txt").is_file() else ""
    text = ["# fp8 products against bf16", "", env, ""]
    headline = []
    speed = lines(out / "speed.jsonl")
    text += ["## gpt-1.3b speed, 24 GB cap", "", "| precision | round | tokens/s | peak GiB |",
              "|---|--:|--:|--:|"]
    for i, r in enumerate(speed):
        tps, peak = r.get("tokens_per_s"), r.get("peak_gpu_bytes")
        text.append(f"| {r.get('precision')} | {i // 2 + 1} | "
                     f"{f'{tps:,.0f}' if isinstance(tps, (int, float)) else r.get('outcome')} | "
                     f"{f'{peak / GIB:.2f}' if isinstance(peak, (int, float)) else '-'} |")
    bf16, fp8 = slowest(speed, "bf16"), slowest(speed, "fp8")
    if bf16 and fp8:
        ratio = fp8["tokens_per_s"] / bf16["tokens_per_s"]
        text += ["", f"Slower rounds: fp8 {fp8['tokens_per_s']:,.0f}, bf16 {bf16['tokens_per_s']:,.0f} "
                      f"tokens/s: **{ratio:.3f}×**."]
        headline.append({"metric": "gpt-1.3b fp8 tokens/s vs bf16", "ours": round(fp8["tokens_per_s"], 1),
                         "reference": round(bf16["tokens_per_s"], 1), "ratio": round(ratio, 3),
                         "unit": "tokens/s",
                         "reference_is": f"autotune's bf16 at the same micro-batch "
                                         f"({bf16.get('micro_batch')}), the slower of its rounds, same call"})
    text.append("")
    loss = {p: tail_loss(lines(out / f"loss-{p}.jsonl")) for p in ("bf16", "fp8")}
    text += ["## gpt-124m loss", ""]
    if loss["bf16"] and loss["fp8"]:
        (b, steps_b), (f, steps_f) = loss["bf16"], loss["fp8"]
        ratio = f / b
        text.append(f"Mean loss of the last {TAIL} of {steps_f} steps: fp8 {f:.4f}, bf16 {b:.4f} "
                     f"({steps_b} steps): **{ratio:.4f}** ({(ratio - 1) * 100:+.2f} %).")
        headline.append({"metric": f"gpt-124m fp8 loss after {steps_f} steps vs bf16", "ours": round(f, 4),
                         "reference": round(b, 4), "ratio": round(ratio, 4), "unit": "nats",
                         "reference_is": f"autotune's bf16 run, same seed and data, mean of the last "
                                         f"{TAIL} steps, same call"})
        other_seed = tail_loss(lines(out / "loss-bf16-seed8.jsonl"))
        if other_seed:
            spread = other_seed[0] / b - 1
            text.append(f"bf16 with seed 8 instead of 7 ends at {other_seed[0]:.4f}: "
                        f"{spread * 100:+.2f} %, the run-to-run spread fp8's difference is read "
                        f"against.")
    else:
        text.append("One of the runs did not finish; no comparison.")
    print("\n".join(text))
    (out / "headline.json").write_text(json.dumps(headline, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
