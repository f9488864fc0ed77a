#!/usr/bin/env python3
"""Summarise strongest_stack.sh's folder as Markdown: each side's fastest fitting batch and the
ratio of the two, for llama-3.2-1b (ours vs transformers + Liger + torch.compile) and gpt-124m
(ours vs torch.compile).

    python3 strongest_report.py OUTDIR > OUTDIR/summary.md

Also writes OUTDIR/headline.json with "llama-3.2-1b tokens/s vs transformers + torch.compile +
Liger" and "gpt-124m b16 tokens/s vs torch.compile" (without the folder and commit).

A side's speed is the best median tokens/s over the settings (micro-batch, and whether every
block is recomputed) that fitted; with two rounds of one setting the slower round is kept, so a
lucky round does not flatter either side. Standard library only.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import GIB, lines  # noqa: E402


def rows(path: pathlib.Path, model: str) -> list[dict]:
    """The records of a .jsonl file that are about `model`; [] if the file is absent."""
    return [r for r in lines(path) if r.get("model") == model]


def setting(r: dict) -> str:
    """How a record's setting is shown: its micro-batch, marked where every block recomputes."""
    return f"{r['micro_batch']}{' (recompute)' if r.get('checkpointing') else ''}"


def per_setting(records: list[dict]) -> dict[tuple[int, bool], dict]:
    """{(micro_batch, recomputes): record}, keeping the slowest fitting round of each setting; a
    setting with no fitting round maps to its last record (its outcome says why)."""
    out: dict[tuple[int, bool], dict] = {}
    for r in records:
        try:
            key = (int(r["micro_batch"]), bool(r.get("checkpointing")))
        except (KeyError, TypeError, ValueError):
            continue
        fits = r.get("outcome") == "fits" and isinstance(r.get("tokens_per_s"), (int, float))
        kept = out.get(key)
        kept_fits = kept is not None and kept.get("outcome") == "fits"
        if kept is None or (fits and (not kept_fits or r["tokens_per_s"] < kept["tokens_per_s"])) \
                or (not fits and not kept_fits):
            out[key] = r
    return out


def best(records: list[dict]) -> dict | None:
    """The fitting record with the highest tokens/s, or None."""
    fitting = [r for r in per_setting(records).values() if r.get("outcome") == "fits"]
    return max(fitting, key=lambda r: r["tokens_per_s"], default=None)


def headline_entry(metric: str, ours: list[dict], ref: list[dict], reference_is: str) -> dict | None:
    """The headline entry comparing each side's best, or None without both."""
    a, b = best(ours), best(ref)
    if not (a and b):
        return None
    return {"metric": metric, "ours": round(a["tokens_per_s"], 1), "reference": round(b["tokens_per_s"], 1),
            "ratio": round(a["tokens_per_s"] / b["tokens_per_s"], 3), "unit": "tokens/s",
            "reference_is": f"{reference_is} at its fastest fitting micro-batch ({setting(b)}; ours "
                            f"{setting(a)}), the slower round of each, 24 GB cap, same call"}


def table(title: str, ours: list[dict], ref: list[dict], ref_name: str) -> list[str]:
    lines = [f"## {title}", "", "| side | micro-batch | outcome | tokens/s | peak GiB |",
             "|---|--:|---|--:|--:|"]
    for name, records in (("autotune", ours), (ref_name, ref)):
        for _, r in sorted(per_setting(records).items()):
            tps = r.get("tokens_per_s")
            peak = r.get("peak_gpu_bytes")
            lines.append(f"| {name} | {setting(r)} | {r.get('outcome', '?')} | "
                         f"{f'{tps:,.0f}' if isinstance(tps, (int, float)) else '-'} | "
                         f"{f'{peak / GIB:.2f}' if isinstance(peak, (int, float)) else '-'} |")
    a, b = best(ours), best(ref)
    lines.append("")
    if a and b:
        lines.append(f"Best: autotune {a['tokens_per_s']:,.0f} tokens/s (mb {setting(a)}), "
                     f"{ref_name} {b['tokens_per_s']:,.0f} (mb {setting(b)}): "
                     f"**{a['tokens_per_s'] / b['tokens_per_s']:.3f}×**.")
    else:
        lines.append("Best: one side has no fitting batch; no ratio.")
    return lines + [""]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = pathlib.Path(argv[1])
    env = (out / "env.txt").read_text(errors="replace").strip() if (out / "env.txt").is_file() else ""
    lines = ["# autotune against the strongest PyTorch stacks, 24 GB cap", "", env, ""]
    llama = (rows(out / "ours-llama.jsonl", "llama-3.2-1b"), rows(out / "liger-compile.jsonl", "llama-3.2-1b")
             + rows(out / "liger-compile-recompute.jsonl", "llama-3.2-1b"))
    lines += table("llama-3.2-1b, bf16, seq 2048", *llama, "transformers+liger+compile")
    gpt = out / "gpt-124m"
    gpt = (rows(gpt / "autotune.jsonl", "gpt-124m"), rows(gpt / "pytorch-compile.jsonl", "gpt-124m"))
    lines += table("gpt-124m, bf16, b16, seq 1024", *gpt, "torch.compile")
    print("\n".join(lines))
    entries = [
        headline_entry("llama-3.2-1b tokens/s vs transformers + torch.compile + Liger", *llama,
                       "transformers LlamaForCausalLM with Liger's RoPE, RMSNorm, SwiGLU and fused linear "
                       "cross-entropy under torch.compile"),
        headline_entry("gpt-124m b16 tokens/s vs torch.compile", *gpt, "PyTorch torch.compile (default mode)"),
    ]
    (out / "headline.json").write_text(json.dumps([e for e in entries if e], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
