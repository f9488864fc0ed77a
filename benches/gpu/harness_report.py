#!/usr/bin/env python3
"""Summarise harness_bench.sh's folder: tuning through the PyTorch harness against PyTorch's
exact largest feasible batch, training with the exports, and the batch-size finders.

    python3 benches/gpu/harness_report.py OUTDIR > OUTDIR/summary.md

Writes OUTDIR/summary.json (every number below, per model) and OUTDIR/headline.json (the
entries for benches/results/headline.json, without the folder and commit, which the caller
adds): "gpt-124m harness plan batch vs PyTorch exact max" and "gpt-124m harness tune seconds vs
Lightning binsearch". Standard library only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import GIB, lines, load  # noqa: E402

HEADLINE_MODEL = "gpt-124m"


def to_answer_s(finder: dict) -> float | None:
    """A finder's seconds from a fresh process to its batch size: its setup (imports, model,
    trainer) and its call. Records without `setup_s` (before it was measured) give None."""
    setup, call = finder.get("setup_s"), finder.get("wall_s")
    if isinstance(setup, (int, float)) and isinstance(call, (int, float)):
        return setup + call
    return None


def fmt(x, spec=",.0f", none="–"):
    return none if x is None else format(x, spec)


def knobs_text(k: dict) -> str:
    c = k.get("checkpointing", {"mode": "none"})
    ckpt = "none" if c.get("mode") == "none" else ("all" if c.get("k") == 1 else f"every-{c.get('k')}")
    return (f"mb={k['micro_batch']} accum={k['grad_accum']} {k['precision']} ckpt={ckpt} "
            f"offload={k.get('offload', 'none')}")


def model_summary(out: Path, model: str) -> dict:
    tune = load(out / f"{model}.tune.time") or {}
    plan = load(out / f"{model}.plan.json")
    exact = load(out / f"{model}.exact.json")
    exact_default = load(out / f"{model}.exact-default.json")
    exports = load(out / f"{model}.exports.json") or {}
    finders = {r.get("finder"): r for r in lines(out / f"{model}.finders.jsonl")}
    trains = {tool: load(out / f"{model}.train-{tool}.json") for tool in ("deepspeed", "trainer")}
    s = {"model": model, "tune": {"exit": tune.get("exit"), "seconds": tune.get("seconds")}}
    if plan:
        m = plan["measured"]
        evidence = plan["evidence"]
        s["tune"].update(
            knobs=plan["knobs"], tokens_per_s=m["tokens_per_s"], peak_gpu_bytes=m["peak_gpu_bytes"],
            peak_host_bytes=m["peak_host_bytes"], trials=len(evidence),
            trial_seconds=round(sum(t["wall_s"] for t in evidence), 2),
            outcomes={o: sum(t["outcome"] == o for t in evidence)
                      for o in sorted({t["outcome"] for t in evidence})},
            provenance=plan.get("provenance"))
        regime = {k: v for k, v in plan["knobs"].items() if k not in ("micro_batch", "grad_accum")}
        fits = [t["request"]["knobs"]["micro_batch"] for t in evidence
                if t["outcome"] == "fits" and all(t["request"]["knobs"].get(k) == v for k, v in regime.items())
                and t["peak_gpu_bytes"] <= (plan["budget"]["gpu_bytes"] or 0) * (1 - plan["budget"]["headroom"])]
        s["tune"]["regime_boundary_found"] = max(fits) if fits else None
    if exact:
        s["exact"] = {k: exact.get(k) for k in ("plan_micro_batch", "feasible_max", "first_infeasible",
                                                "runs_max", "first_failing", "ratio", "within_2pct",
                                                "exact", "seconds", "allocator", "contiguous_max")}
        s["exact"]["trials"] = len(exact.get("trials", []))
    if exact_default:
        s["exact_default"] = {k: exact_default.get(k) for k in (
            "plan_micro_batch", "feasible_max", "first_infeasible", "contiguous_max", "ratio",
            "exact", "seconds")}
    s["exports"] = exports
    s["train"] = trains
    s["finders"] = finders
    return s


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    meta = load(out / "meta.json") or {}
    models = meta.get("models") or []
    summary = {"meta": meta, "models": {m: model_summary(out, m) for m in models}}
    headline = []

    print(f"# Tuning through the PyTorch harness on `{meta.get('device', '?')}`\n")
    cap = meta.get("allocator_cap_mib")
    emulation = ("no GPU" if cap is None else
                 f"the card emulated with {meta.get('context_mib', '?')} MiB counted outside PyTorch's "
                 f"allocator (its allocator capped at {cap} MiB, as the finders' are)")
    print(f"{meta.get('date', '?')}, commit {meta.get('commit', '?')}, GPU {meta.get('gpu') or 'none'}, "
          f"torch {meta.get('torch', '?')}, DeepSpeed {meta.get('deepspeed') or 'not installed'}; "
          f"{emulation}.\n")
    for model, s in summary["models"].items():
        t = s["tune"]
        print(f"## {model}\n")
        print("### Tune (`autotune tune --backend exec -- python3 harness/examples/…`)\n")
        if "knobs" in t:
            p = t["provenance"] or {}
            print(f"- wall time **{t['seconds']} s** (exit {t['exit']}), {t['trials']} trials "
                  f"({t['trial_seconds']} s in trials; outcomes {t['outcomes']})")
            print(f"- plan `{knobs_text(t['knobs'])}`: {fmt(t['tokens_per_s'])} tokens/s, peak GPU "
                  f"{t['peak_gpu_bytes'] / GIB:.2f} GiB, host {t['peak_host_bytes'] / GIB:.2f} GiB")
            print(f"- provenance: engine `{p.get('engine')}` {p.get('engine_version', '')}, backend "
                  f"`{p.get('backend')}`, device {p.get('device')}")
            print(f"- the largest feasible micro-batch the search measured in the plan's regime: "
                  f"{t['regime_boundary_found']}\n")
        else:
            print(f"- no plan (exit {t['exit']}, {t['seconds']} s; see {model}.tune.log)\n")
        exports = s["exports"]
        if exports:
            print("Exports without `--allow-engine-mismatch`: " + ", ".join(
                f"{f} {'ok' if rc == 0 else f'exit {rc}'}" for f, rc in exports.items()) + "\n")

        e = s.get("exact")
        headroom = ((load(out / f"{model}.exact.json") or {}).get("budget") or {}).get("headroom", 0.05)
        print("### The plan against PyTorch's exact largest feasible micro-batch\n")
        if e and e.get("feasible_max"):
            verdict = "**within 2 %**" if e["within_2pct"] else "**not within 2 %**"
            print(f"Bisection with real steps through the same harness and cap, at the plan's knobs "
                  f"({e['trials']} trials, {e['seconds']} s{'' if e['exact'] else ', cut short by its time limit'}): "
                  f"largest feasible (peak within the budget less headroom) **{e['feasible_max']}** "
                  f"(first infeasible {e['first_infeasible']}); largest that runs at all {e['runs_max']} "
                  f"(first failing {e['first_failing']}). Plan {e['plan_micro_batch']}: "
                  f"{e['ratio']:.3f} of it, {verdict}.\n")
            allocator = e.get("allocator")
            setting = ("PyTorch's default allocator" if allocator == "" else
                       f"PYTORCH_CUDA_ALLOC_CONF={allocator}" if allocator else "the runner's environment")
            print(f"The runner ran under {setting}, as the plan's trials did.\n")
            d = s.get("exact_default")
            if d and d.get("feasible_max"):
                print(f"Under PyTorch's default allocator instead: largest feasible **{d['feasible_max']}** "
                      f"(first infeasible {d['first_infeasible']}), every one up to "
                      f"{d['contiguous_max']} feasible; the plan is {d['ratio']:.3f} of it.\n")
            if model == HEADLINE_MODEL:
                headline.append({
                    "metric": f"{model} harness plan batch vs PyTorch exact max",
                    "ours": e["plan_micro_batch"], "reference": e["feasible_max"],
                    "ratio": round(e["ratio"], 3), "unit": "sequences",
                    "reference_is": f"PyTorch {meta.get('torch', '')} eager's largest micro-batch at the "
                                    "plan's knobs whose peak stays within the same emulated card less "
                                    f"{headroom:.0%} headroom, by bisection with real steps through the "
                                    f"same harness under the plan's allocator setting ({setting}), "
                                    "same call",
                })
        else:
            print("No bisection result (see the log).\n")

        print("### Training with the exports\n")
        print("| tool | steps | out of memory | peak GPU | tokens/s | last loss | error |")
        print("|---|--:|---|--:|--:|--:|---|")
        for tool, r in s["train"].items():
            if not r:
                print(f"| {tool} | – | – | – | – | – | not run |")
                continue
            peak = "–" if r.get("peak_gpu_bytes") is None else f"{r['peak_gpu_bytes'] / GIB:.2f} GiB"
            note = r.get("error", "")[:120] + (f" ({r['config_modified']})" if r.get("config_modified") else "")
            print(f"| {tool} | {r['steps_done']}/{r['steps']} | {'**yes**' if r['out_of_memory'] else 'no'} | "
                  f"{peak} | {fmt(r.get('tokens_per_s'))} | {fmt(r.get('last_loss'), '.3f')} | {note} |")
        print()

        print("### Batch-size finders on the same model and cap\n")
        print("| search | to an answer, s | call alone, s | process s | trials | batch | tokens/s at it | OOM training at it |")
        print("|---|--:|--:|--:|--:|--:|--:|---|")
        if "knobs" in t:
            print(f"| autotune tune (harness) | {t['seconds']} | – | {t['seconds']} | {t['trials']} | "
                  f"{knobs_text(t['knobs'])} | {fmt(t['tokens_per_s'])} | "
                  f"{'yes' if any((r or {}).get('out_of_memory') for r in s['train'].values()) else 'no'} |")
        for name, r in s["finders"].items():
            if r.get("skipped") or r.get("error"):
                print(f"| {name} | – | – | – | – | – | – | {r.get('skipped') or r.get('error', '')[:80]} |")
                continue
            print(f"| {name} ({r.get('framework', '')}) | {fmt(to_answer_s(r), '.1f')} | "
                  f"{fmt(r.get('wall_s'), '.1f')} | {fmt(r.get('process_s'), '.1f')} | {r.get('trials')} | "
                  f"{r.get('batch')} | {fmt(r.get('tokens_per_s'))} | {'yes' if r.get('oom_after') else 'no'} |")
        print("\n*To an answer*: from a fresh process to the batch size. autotune's is the whole `tune` "
              "process (the runner's start and imports, the model, every trial, the verification, the "
              "plan written); a finder's is its process's start, imports, model and trainer, then the "
              "finder's call (*call alone*). A finder's process time also includes the training it "
              "goes on to time at the batch found.\n")
        lightning = s["finders"].get("lightning-binsearch") or {}
        lightning_s = to_answer_s(lightning)
        if model == HEADLINE_MODEL and t.get("seconds") and lightning_s:
            call = lightning.get("wall_s")
            headline.append({
                "metric": f"{model} harness tune seconds vs Lightning binsearch",
                "ours": t["seconds"], "reference": round(lightning_s, 2),
                "ratio": round(t["seconds"] / lightning_s, 3), "unit": "s",
                "reference_is": f"{lightning.get('framework', 'Lightning')} BatchSizeFinder (binsearch, "
                                f"{lightning.get('steps_per_trial', 3)} steps per trial) on the same model "
                                f"and cap, from a fresh process to its answer as ours is (its call alone: "
                                f"{fmt(call, '.1f')} s, ratio {fmt(t['seconds'] / call if call else None, '.2f')}), "
                                f"same call",
            })

    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "headline.json").write_text(json.dumps(headline, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
