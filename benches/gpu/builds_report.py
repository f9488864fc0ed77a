#!/usr/bin/env python3
"""Summarise builds_bench.sh's folder: for each row (model, precision, micro-batch and
accumulation), each build's slower round of tokens/s (so a lucky round flatters none) and its
ratio to the baseline's, the first build named; then, for each training run in losses/, each
build's largest relative difference from the baseline's loss at the same step.

    python3 builds_report.py OUTDIR BASELINE [BUILD ...] > OUTDIR/summary.md

The tests' result line comes first where OUTDIR/tests.txt exists. Standard library only.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import GIB, lines  # noqa: E402


def rounds(rows: list[dict], build: str, row: str) -> list[dict]:
    """The probes of `build` on `row`, in the order they ran."""
    return [r for r in rows if r.get("build") == build and r.get("row") == row]


def slower(probes: list[dict]) -> float | None:
    """The slower round's tokens/s, or None unless every round fit (a round that did not is a
    difference the ratio must not hide)."""
    speeds = [r.get("tokens_per_s") for r in probes]
    if not probes or any(r.get("outcome") != "fits" for r in probes) \
            or not all(isinstance(s, (int, float)) for s in speeds):
        return None
    return min(speeds)


def cell(probes: list[dict]) -> str:
    """Each round's tokens/s, or its outcome where it did not fit."""
    parts = []
    for r in probes:
        tps = r.get("tokens_per_s")
        fits = r.get("outcome") == "fits" and isinstance(tps, (int, float))
        parts.append(f"{tps:,.0f}" if fits else str(r.get("outcome", "no result")))
    return " / ".join(parts) or "no result"


def tests_line(out: pathlib.Path) -> list[str]:
    """The tests' summary: their result line and exit status, and any failure named."""
    path = out / "tests.txt"
    if not path.is_file():
        return []
    text = path.read_text(errors="replace")
    results = re.findall(r"^test result: .*$", text, re.M)
    status = re.findall(r"^tests exit (\d+)$", text, re.M)
    failed = re.findall(r"^test (\S+) \.\.\. FAILED$", text, re.M)
    line = f"Tests: {results[-1] if results else 'no result line'}"
    line += f" (exit {status[-1]})" if status else " (did not finish)"
    out_lines = [line]
    if failed:
        out_lines.append("Failed: " + ", ".join(f"`{f}`" for f in failed))
    return out_lines + [""]


def losses(out: pathlib.Path, builds: list[str]) -> list[str]:
    """The loss table: per run (model, precision, micro-batch), each build's steps, last loss and
    largest relative difference from the baseline's loss at the same step."""
    folder = out / "losses"
    base = builds[0]
    runs = sorted(p.name[len(base) + 1:-len(".jsonl")] for p in folder.glob(f"{base}-*.jsonl")) \
        if folder.is_dir() else []
    if not runs:
        return []
    text = ["", "| run | build | steps | last loss | largest difference from " + base + " |",
            "|---|---|--:|--:|--:|"]
    for run in runs:
        by_step = {b: {r["step"]: r["loss"] for r in lines(folder / f"{b}-{run}.jsonl")
                       if isinstance(r.get("step"), int) and isinstance(r.get("loss"), (int, float))}
                   for b in builds}
        reference = by_step[base]
        for build in builds:
            got = by_step[build]
            shared = [s for s in got if s in reference and reference[s] != 0]
            worst = max((abs(got[s] - reference[s]) / abs(reference[s]) for s in shared), default=None)
            complete = shared and len(shared) == len(reference)
            diff = f"{worst * 100:.3f} %" if worst is not None and complete else "not comparable"
            last = f"{got[max(got)]:.4f}" if got else "no steps"
            text.append(f"| {run} | {build} | {len(got)} | {last} | {diff} |")
    return text


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, builds = pathlib.Path(argv[1]), argv[2:]
    env = (out / "env.txt").read_text(errors="replace").strip() if (out / "env.txt").is_file() else ""
    text = ["# Builds against each other", "", env, ""] + tests_line(out)
    rows = lines(out / "probes.jsonl")
    order = list(dict.fromkeys(r.get("row") for r in rows if r.get("row")))
    text += ["| row | build | tokens/s by round | slower round | vs " + builds[0] + " | peak GiB |",
             "|---|---|--:|--:|--:|--:|"]
    for row in order:
        base = slower(rounds(rows, builds[0], row))
        for build in builds:
            probes = rounds(rows, build, row)
            speed = slower(probes)
            ratio = f"{speed / base:.3f}×" if speed and base else "-"
            peaks = [r["peak_gpu_bytes"] for r in probes if isinstance(r.get("peak_gpu_bytes"), (int, float))]
            peak = f"{max(peaks) / GIB:.2f}" if peaks else "-"
            text.append(f"| {row} | {build} | {cell(probes)} | "
                        f"{f'{speed:,.0f}' if speed else '-'} | {ratio} | {peak} |")
    if not order:
        text.append("| - | - | no probes | - | - | - |")
    text += losses(out, builds)
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
