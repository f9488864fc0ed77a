#!/usr/bin/env python3
"""Summarise offload_bench.sh's folder: autotune's offloaded gpt-1.3b against DeepSpeed
ZeRO-2 + CPU offload at the same micro-batches, and the gpt-2b tune and training run.

    python3 offload_report.py OUTDIR > OUTDIR/summary.md

Standard library only. Also writes OUTDIR/headline.json: the entries for
benches/results/headline.json (without the folder and commit, which the caller adds).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import GIB, lines, load  # noqa: E402


def gib(x) -> str:
    return "–" if x is None else f"{x / GIB:.2f}"


def fits(r) -> bool:
    return bool(r) and r.get("outcome") == "fits" and r.get("tokens_per_s")


TARGET_GBPS = 25.0  # an RTX 4090's PCIe 4 x16, pinned


def adam_seconds(log: Path) -> dict:
    """Median host Adam seconds per streamed step, by micro-batch, from ours.log's
    `streamed step` lines (RUST_LOG=autotune::offload=debug); each trial's lines come before
    its `trial phases knobs=mb=N` line."""
    found, pending = {}, []
    if not log.exists():
        return found
    for line in log.read_text(errors="replace").splitlines():
        if "streamed step" in line and "adam_s=" in line:
            pending.append(float(line.split("adam_s=")[1].split()[0]))
        elif "trial phases" in line and "knobs=mb=" in line:
            mb = int(line.split("knobs=mb=")[1].split()[0])
            if pending and "offload=optimizer" in line:
                later = sorted(pending[1:] or pending)  # the first step faults pages in
                found[mb] = later[len(later) // 2]
            pending = []
    return found


def target_ms(r) -> str:
    """The step retimed for a 4090's link from the trial's host-link bytes."""
    link = (r or {}).get("host_link")
    if not fits(r) or not link:
        return "–"
    measured = r["step_time_median_s"] - link.get("added_s", 0.0)
    extra = link["bytes_per_step"] * max(0.0, 1 / TARGET_GBPS - 1 / link["measured_gbps"]) / 1e9
    return f"{(measured + extra) * 1e3:.0f}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    headline = []
    print("# Optimizer offload on the emulated RTX 4090 (24564 MiB), 32 GB host budget, bf16\n")
    print("Host link: the GPU machine's (not a 4090's PCIe 4); the `at 25 GB/s` column retimes "
          "each step for a 4090's link from the bytes it copied (copies share the device's stream, "
          "so each byte's extra time is added).\n")
    ours = {r.get("micro_batch"): r for r in lines(out / "ours.jsonl")}
    ds = {r.get("micro_batch"): r for r in lines(out / "deepspeed.jsonl")}
    device = {r.get("micro_batch"): r for r in lines(out / "ours-device.jsonl")}
    adam = adam_seconds(out / "ours.log")
    print("## gpt-1.3b: autotune offload vs DeepSpeed ZeRO-2 + CPU offload\n")
    print("| micro-batch | ours tok/s | ours ms/step | at 25 GB/s | ours GPU GiB | ours host GiB "
          "| DeepSpeed tok/s | DeepSpeed ms/step | DeepSpeed GPU GiB | DeepSpeed host RSS GiB | ratio |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for mb in sorted(set(ours) | set(ds), key=lambda m: m or 0):
        a, b = ours.get(mb), ds.get(mb)
        cell = lambda r, k: (f"{r[k]:.0f}" if fits(r) and r.get(k) is not None else  # noqa: E731
                             ("–" if r is None else r.get("outcome", "?")))
        ms = lambda r: f"{r['step_time_median_s'] * 1e3:.0f}" if fits(r) else "–"  # noqa: E731
        ratio = "–"
        if fits(a) and fits(b):
            ratio = f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}"
            headline.append({
                "metric": f"gpt-1.3b offload mb{mb} speed vs DeepSpeed",
                "ours": round(a["tokens_per_s"], 1), "reference": round(b["tokens_per_s"], 1),
                "ratio": round(a["tokens_per_s"] / b["tokens_per_s"], 3), "unit": "tokens/s",
                "reference_is": "DeepSpeed 0.19.8 ZeRO-2 + CPU optimizer offload, same call, H200 host link",
            })
        print(f"| {mb} | {cell(a, 'tokens_per_s')} | {ms(a)} | {target_ms(a)} | {gib(a and a.get('peak_gpu_bytes'))} "
              f"| {gib(a and a.get('peak_host_bytes'))} | {cell(b, 'tokens_per_s')} | {ms(b)} "
              f"| {gib(b and b.get('peak_gpu_bytes'))} | {gib(b and b.get('peak_host_rss_bytes'))} | {ratio} |")
    print("\n### The floor: the slowest of the step's parts, measured apart\n")
    print("| micro-batch | device passes ms (no offload, uncapped) | link ms (bytes / measured GB/s) "
          "| host Adam ms (median streamed step) | floor ms | ours ms | ours / floor |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for mb in sorted(ours, key=lambda m: m or 0):
        a = ours[mb]
        if not fits(a):
            continue
        dev = device.get(mb)
        parts = [dev["step_time_median_s"] if fits(dev) else None]
        link = a.get("host_link")
        parts.append(link["bytes_per_step"] / link["measured_gbps"] / 1e9 if link else None)
        parts.append(adam.get(mb))
        known = [p for p in parts if p is not None]
        floor = max(known) if known else None
        fmt = lambda x: "–" if x is None else f"{x * 1e3:.0f}"  # noqa: E731
        ratio = f"{a['step_time_median_s'] / floor:.2f}" if floor else "–"
        print(f"| {mb} | {fmt(parts[0])} | {fmt(parts[1])} | {fmt(parts[2])} | {fmt(floor)} "
              f"| {fmt(a['step_time_median_s'])} | {ratio} |")
        if link:
            print(f"\nmb {mb}: {link['bytes_per_step'] / 1e9:.2f} GB per step over a link measured at "
                  f"{link['measured_gbps']:.1f} GB/s.")
    a4 = ours.get(4)
    if fits(a4):
        headline.append({
            "metric": "gpt-1.3b offload host GiB",
            "ours": round(a4["peak_host_bytes"] / GIB, 2),
            "reference": round(ds[4]["peak_host_rss_bytes"] / GIB, 2) if fits(ds.get(4)) and ds[4].get("peak_host_rss_bytes") else None,
            "unit": "GiB",
            "reference_is": "DeepSpeed 0.19.8 peak host RSS, same call",
        })
        h = headline[-1]
        h["ratio"] = round(h["ours"] / h["reference"], 3) if h["reference"] else None

    print("\n## gpt-2b on rtx4090-32g\n")
    plan = load(out / "gpt-2b.plan.json")
    tune = load(out / "tune-2b.time")
    train = load(out / "train-2b.json")
    if tune:
        print(f"- tune: exit {tune.get('exit')}, {tune.get('seconds')} s")
    if plan:
        knobs = plan.get("knobs", plan.get("plan", {}).get("knobs"))
        print(f"- plan knobs: `{json.dumps(knobs)}`")
        pred = plan.get("predicted") or plan.get("prediction")
        if pred:
            print(f"- predicted: `{json.dumps(pred)[:400]}`")
    if train:
        print(f"- train: `{json.dumps(train)[:600]}`")
    host = (plan or {}).get("measured", {}).get("peak_host_bytes")
    if host:
        headline.append({
            "metric": "gpt-2b host peak GiB", "ours": round(host / GIB, 2), "reference": 30.0,
            "ratio": round(host / GIB / 30.0, 3), "unit": "GiB",
            "reference_is": "the target: at most 30 GiB of the 32 GB box's host memory",
        })
    (out / "headline.json").write_text(json.dumps(headline, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
