#!/usr/bin/env python3
"""Summarise one tune_bench.sh run as Markdown (standard library only).

    python3 benches/gpu/tune_report.py OUTDIR MODEL            # writes OUTDIR/MODEL.summary.md
    python3 benches/gpu/tune_report.py OUTDIR MODEL --out -    # to stdout only

Reads OUTDIR/MODEL.{plan.json, grid.jsonl, finders.jsonl, run.json, log}; any of them may be
missing or partial, and the matching section then says so. Sections:

(a) search cost: tune's wall time and trials (len(evidence)) against each finder's wall time,
    trials and batch found; with `tune -v`, where the trials' time went (the `trial phases`
    debug lines in the log: setup, steps, evaluation, checkpoint dry run);
(b) plan quality: the plan's measured tokens/s over the best feasible grid point (feasible = fits
    and the measured peaks within (1 - budget.headroom) x budget.gpu_bytes / host_bytes, read
    from the plan);
(c) memory model error: per regime, peak = a + b * micro_batch fitted by relative least squares to the
    plan's `fits` trials of that regime without accumulation, evaluated on the grid's points;
(d) the full run: trained without running out of memory?

The summary also goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

TARGET_PLAN_RATIO = 0.98
TARGET_MEM_ERROR = 0.03
MIB = 2**20
GIB = 2**30


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------

def load_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f), None
    except FileNotFoundError:
        return None, "missing"
    except (OSError, ValueError) as e:
        return None, f"unreadable ({e})"


def load_jsonl(path: str):
    rows, bad = [], 0
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    bad += 1
                    continue
                if isinstance(row, dict):
                    rows.append(row)
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, f"unreadable ({e})"
    return rows, (f"{bad} unreadable line(s)" if bad else None)


PHASES = ("setup_s", "steps_s", "eval_s", "checkpoint_s")
PHASE_LINE = re.compile(r"trial phases .*?" + r" ".join(rf"{p}=([-+.\deE]+)" for p in PHASES))


def tune_phases(path: str):
    """Per-phase seconds summed over the tune stage's `trial phases` lines (between the log's
    `== tune` marker and the next `== ` marker), and how many trials logged them; None without
    any."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    totals, trials, inside = dict.fromkeys(PHASES, 0.0), 0, False
    for line in lines:
        if line.startswith("== "):
            inside = line.strip() == "== tune"
            continue
        m = PHASE_LINE.search(line) if inside else None
        if m:
            trials += 1
            for phase, value in zip(PHASES, m.groups()):
                totals[phase] += float(value)
    return (totals, trials) if trials else None


# ---------------------------------------------------------------------------
# Knobs and regimes
# ---------------------------------------------------------------------------

def knobs_of(row: dict) -> dict | None:
    req = row.get("request")
    if isinstance(req, dict) and isinstance(req.get("knobs"), dict):
        return req["knobs"]
    return row.get("knobs") if isinstance(row.get("knobs"), dict) else None


def ckpt_text(c) -> str:
    if not isinstance(c, dict) or c.get("mode") in (None, "none"):
        return "none"
    k = c.get("k")
    return "all" if k == 1 else f"every-{k}"


def regime_of(knobs: dict | None):
    if not knobs:
        return None
    return (knobs.get("precision"), ckpt_text(knobs.get("checkpointing")), knobs.get("offload", "none"))


def regime_label(r) -> str:
    return "?" if r is None else f"{r[0]} ckpt={r[1]} offload={r[2]}"


def knobs_label(k: dict | None) -> str:
    if not k:
        return "?"
    return f"mb={k.get('micro_batch')} accum={k.get('grad_accum', 1)} {regime_label(regime_of(k))}"


# ---------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------

def fmt(x, spec="{:,.0f}", none="–") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return spec.format(x)


def pct(x, none="–") -> str:
    return fmt(None if x is None else 100 * x, "{:.1f} %", none)


def gib(x) -> str:
    return fmt(None if x is None else x / GIB, "{:.2f} GiB")


def verdict(ok) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


# ---------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------

# A regime's model is judged where the search built one: at least this many distinct
# micro-batches, and on grid points up to twice the largest of them (the search itself never
# trusts a prediction further out without probing it).
MIN_MODEL_POINTS = 3
MAX_EXTRAPOLATION = 2
# The plan's memory model (`MemoryModel::fit`) fits only its upper range of micro-batches: those
# at least 1/UPPER_RANGE_DIVISOR of the largest, or the three largest (fit/memory.rs).
UPPER_RANGE_DIVISOR = 8


def upper_range(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The points the plan's memory model is fitted to (see UPPER_RANGE_DIVISOR)."""
    if not points:
        return []
    largest = max(mb for mb, _ in points)
    upper = [(mb, y) for mb, y in points if mb * UPPER_RANGE_DIVISOR >= largest]
    if len(upper) >= 3:
        return upper
    return sorted(points, key=lambda p: -p[0])[:max(3, len(upper))]


def least_squares(points: list[tuple[float, float]]):
    """y = a + b x by ordinary least squares, as `AffineBytes::fit` does; None below two
    distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    b = sxy / sxx
    return my - b * mx, b


class PlanMemoryModel:
    """The plan's memory model as `MemoryModel::fit` builds it: least squares over the upper
    range of the trials, and never below a peak measured at a micro-batch at most as large
    (memory does not shrink as the batch grows)."""

    def __init__(self, law: tuple[float, float], pts: list[tuple[int, float]]):
        self.law = law
        self.measured = sorted(pts)

    @classmethod
    def fit(cls, pts: list[tuple[int, float]]):
        """The model of `pts`; None when its upper range has fewer than two distinct micro-batches."""
        law = least_squares(upper_range(pts))
        return cls(law, pts) if law else None

    def predict(self, mb: int) -> float:
        a, b = self.law
        floor = max((y for x, y in self.measured if x <= mb), default=0)
        return max(a + b * mb, floor)


def model_range_errors(pts, grid_points, key):
    """Relative errors on the grid of the law fitted to the model's upper range alone (no
    measured floor), judged there: from the smallest micro-batch of that range to
    MAX_EXTRAPOLATION× the largest."""
    upper = upper_range(pts)
    fit = least_squares(upper)
    if not fit:
        return []
    lo, hi = min(mb for mb, _ in upper), MAX_EXTRAPOLATION * max(mb for mb, _ in upper)
    return [abs(fit[0] + fit[1] * g["micro_batch"] - g[key]) / g[key] for g in grid_points
            if g.get("outcome") == "fits" and g.get(key) and lo <= g["micro_batch"] <= hi]


class Budget:
    def __init__(self, plan: dict | None):
        b = (plan or {}).get("budget") or {}
        dev = (plan or {}).get("device") or {}
        self.known = bool(b)
        self.headroom = b.get("headroom", 0.05)
        self.gpu_bytes = b.get("gpu_bytes")
        self.host_bytes = b.get("host_bytes")
        self.on_gpu = (dev.get("kind") == "cuda") if dev else self.gpu_bytes is not None
        self.usable_gpu = None if self.gpu_bytes is None else math.floor(self.gpu_bytes * (1 - self.headroom))
        self.usable_host = None if self.host_bytes is None else math.floor(self.host_bytes * (1 - self.headroom))

    def feasible(self, row: dict) -> bool:
        if row.get("outcome") != "fits":
            return False
        g, h = row.get("peak_gpu_bytes"), row.get("peak_host_bytes")
        if self.usable_gpu is not None and (g is None or g > self.usable_gpu):
            return False
        if self.usable_host is not None and h is not None and h > self.usable_host:
            return False
        return True

    def memory_key(self) -> str:
        # The memory the device budget is about: the GPU's, or the host's on a CPU target.
        return "peak_gpu_bytes" if self.on_gpu else "peak_host_bytes"

    def describe(self) -> str:
        if not self.known:
            return "unknown (no plan); feasibility uses outcome only"
        parts = []
        if self.gpu_bytes is not None:
            parts.append(f"GPU {self.gpu_bytes / MIB:,.0f} MiB (usable {self.usable_gpu / MIB:,.0f} MiB)")
        if self.host_bytes is not None:
            parts.append(f"host {self.host_bytes / GIB:.1f} GiB (usable {self.usable_host / GIB:.2f} GiB)")
        return ", ".join(parts) + f", headroom {self.headroom:.0%}"


def report(outdir: str, model: str) -> str:
    base = os.path.join(outdir, model)
    plan, plan_err = load_json(base + ".plan.json")
    grid, grid_err = load_jsonl(base + ".grid.jsonl")
    finders, find_err = load_jsonl(base + ".finders.jsonl")
    meta, meta_err = load_json(base + ".run.json")
    meta = meta if isinstance(meta, dict) else {}

    has_plan = isinstance(plan, dict) and "schema_version" in plan
    no_plan = isinstance(plan, dict) and plan.get("feasible") is False
    evidence = plan.get("evidence", []) if isinstance(plan, dict) else []
    budget = Budget(plan if has_plan else None)
    grid_points = [g for g in (grid or []) if "outcome" in g]
    if not budget.known:
        # No plan to say which memory the budget is about: a GPU if the grid measured one.
        budget.on_gpu = any((g.get("peak_gpu_bytes") or 0) > 0 for g in grid_points + evidence)
    grid_skips = [g for g in (grid or []) if "skipped" in g]
    tune = meta.get("tune") or {}
    run = meta.get("run")

    lines = [f"# autotune tune vs. exhaustive grid and batch-size finders: `{model}`", ""]
    env = [f"device profile `{meta.get('device', '?')}`"]
    if meta.get("gpu"):
        env.append(f"GPU {meta['gpu']}")
    if meta.get("commit"):
        env.append(f"commit {meta['commit']}")
    if meta.get("total_s") is not None:
        env.append(f"bench {meta['total_s']:.0f} s")
    lines += [", ".join(env) + ".", ""]
    problems = [f"`{model}.{name}`: {err}" for name, err in
                (("plan.json", plan_err), ("grid.jsonl", grid_err), ("finders.jsonl", find_err),
                 ("run.json", meta_err)) if err]
    if no_plan:
        problems.append(f"tune found no feasible plan: {plan.get('hint', '')}")
    elif plan is not None and not has_plan:
        problems.append("the plan file is not a plan")
    if tune.get("exit_code") not in (None, 0):
        problems.append(f"tune exited {tune['exit_code']}")
    if problems:
        lines += ["Missing or failed pieces: " + "; ".join(problems) + ".", ""]

    # ---- (a) search cost -------------------------------------------------------------
    ev_wall = sum(e.get("wall_s") or 0 for e in evidence) if evidence else None
    lightning = next((f for f in (finders or []) if f.get("finder") == "lightning-binsearch"), None)
    acc = next((f for f in (finders or []) if f.get("finder") == "accelerate"), None)
    rows = [["autotune tune", fmt(tune.get("wall_s"), "{:.1f}"), fmt(ev_wall, "{:.1f}"),
             str(len(evidence)) if evidence else "–",
             knobs_label(plan.get("knobs")) if has_plan else "none",
             fmt(plan["measured"].get("tokens_per_s")) if has_plan else "–", "–"]]
    for f in finders or []:
        note = f.get("skipped") or f.get("error")
        rows.append([
            f"{f.get('finder')} (PyTorch)" + (f" — {note}" if note else ""),
            fmt(f.get("wall_s"), "{:.1f}"), "–", fmt(f.get("trials"), "{}"),
            f"batch {f['batch']}" if f.get("batch") else "–",
            fmt(f.get("tokens_per_s")),
            "–" if f.get("oom_after") is None else ("yes" if f["oom_after"] else "no"),
        ])
    lines += ["## (a) Search cost", ""]
    lines += table(["search", "wall s", "in trials s", "trials", "result", "tokens/s at result",
                    "OOM when training at it"], rows)
    lw = lightning.get("wall_s") if lightning else None
    tw = tune.get("wall_s")
    tune_faster = None if (lw is None or tw is None) else tw < lw
    lines += ["", "autotune's wall time is the whole `tune` process (start-up, every trial, the "
              "verification); 'in trials' sums the evidence's `wall_s`. A finder's wall time is the "
              "finder call alone, in a process that had already imported its framework and built the "
              "model; its tokens/s are PyTorch's (the finder's framework, 6 timed steps after 2 warm-up "
              "at the batch found), not autotune's. "
              f"Target: tune time below Lightning's — {verdict(tune_faster)}"
              + ("" if tune_faster is None else f" ({tw:.1f} s vs {lw:.1f} s)") + ".", ""]
    phases = tune_phases(base + ".log")
    if phases:
        totals, n = phases
        inside = sum(totals.values())
        lines += [f"Where the trials' time went (`tune -v`, {n} trials that ran to the end): "
                  f"setup {totals['setup_s']:.1f} s, steps {totals['steps_s']:.1f} s, evaluation "
                  f"{totals['eval_s']:.1f} s, checkpoint dry run {totals['checkpoint_s']:.1f} s "
                  f"(sum {inside:.1f} s; trials that ran out of memory log no phases).", ""]

    # ---- (b) plan vs grid best ---------------------------------------------------------
    lines += ["## (b) Plan vs. the best feasible grid point", ""]
    lines += [f"Budget (from the plan): {budget.describe()}.", ""]
    feasible = [g for g in grid_points if budget.feasible(g) and g.get("tokens_per_s")]
    best = max(feasible, key=lambda g: g["tokens_per_s"]) if feasible else None
    ratio = None
    if has_plan and best:
        ratio = plan["measured"]["tokens_per_s"] / best["tokens_per_s"]
    by_regime: dict = {}
    for g in grid_points:
        by_regime.setdefault(regime_of(knobs_of(g)), []).append(g)
    rows = []
    for r, pts in by_regime.items():
        fits = [g for g in pts if g.get("outcome") == "fits"]
        feas = [g for g in pts if budget.feasible(g) and g.get("tokens_per_s")]
        rb = max(feas, key=lambda g: g["tokens_per_s"]) if feas else None
        ooms = sorted(g.get("micro_batch") or (knobs_of(g) or {}).get("micro_batch") for g in pts
                      if g.get("outcome") == "out_of_memory")
        other = [g for g in pts if g.get("outcome") not in ("fits", "out_of_memory")]
        skipped = [s for s in grid_skips if s.get("regime") == (pts[0].get("regime") if pts else None)]
        rows.append([
            regime_label(r), str(len(pts)),
            fmt(max((g["micro_batch"] for g in fits), default=None), "{}"),
            fmt(ooms[0] if ooms else None, "{}"),
            fmt(rb.get("micro_batch") if rb else None, "{}"),
            fmt(rb.get("tokens_per_s") if rb else None),
            gib(rb.get(budget.memory_key())) if rb else "–",
            ", ".join(f"mb={g.get('micro_batch')} {g.get('outcome')}" for g in other) or "",
            f"from mb={skipped[0]['micro_batch']}" if skipped else "",
        ])
    regimes_only_skipped = sorted({s.get("regime") for s in grid_skips}
                                  - {g.get("regime") for g in grid_points})
    for label in regimes_only_skipped:
        rows.append([label, "0", "–", "–", "–", "–", "–", "", "all (time limit)"])
    if rows:
        lines += table(["regime", "points", "largest fit", "first OOM", "best feasible mb",
                        "tokens/s", "peak", "errors", "skipped (time)"], rows)
        lines.append("")
    else:
        lines.append("No grid points.")
    if has_plan:
        m = plan["measured"]
        lines.append(f"Plan: {knobs_label(plan['knobs'])}, measured {fmt(m.get('tokens_per_s'))} tokens/s, "
                     f"peak GPU {gib(m.get('peak_gpu_bytes'))}, host {gib(m.get('peak_host_bytes'))}.")
    if best:
        lines.append(f"Grid best feasible: {knobs_label(knobs_of(best))}, {fmt(best['tokens_per_s'])} tokens/s, "
                     f"peak {gib(best.get(budget.memory_key()))}.")
    lines += ["", f"Plan ÷ grid best: {pct(ratio)} — target ≥ {TARGET_PLAN_RATIO:.0%}: "
              f"{verdict(None if ratio is None else ratio >= TARGET_PLAN_RATIO)}."
              + (" The grid was cut short by its time limit, so its best may be missing."
                 if grid_skips else ""), ""]

    # ---- (c) memory model error --------------------------------------------------------
    key = budget.memory_key()
    lines += ["## (c) Memory model on the grid", ""]
    lines += [f"Per regime, the plan's memory model as `autotune` builds it (`MemoryModel::fit`): `{key} = "
              "a + b·micro_batch` by least squares over the upper range of the plan's `fits` trials of that "
              f"regime with grad_accum = 1 (the verification included; at least 1/{UPPER_RANGE_DIVISOR} of the "
              "largest micro-batch, or the three largest), never below a peak measured at a micro-batch at most "
              "as large. It is evaluated on the grid points from the smallest trial's micro-batch up to "
              f"{MAX_EXTRAPOLATION}× the largest. Regimes the search dropped after fewer than "
              f"{MIN_MODEL_POINTS} distinct micro-batches have no model to judge (their errors are shown "
              "but not counted). Relative error = |predicted − measured| ÷ measured.", ""]
    ev_by_regime: dict = {}
    for e in evidence:
        k = knobs_of(e)
        if e.get("outcome") == "fits" and k and k.get("grad_accum", 1) == 1 and e.get(key) is not None:
            ev_by_regime.setdefault(regime_of(k), []).append((k["micro_batch"], e[key]))
    usable = budget.usable_gpu if budget.on_gpu else budget.usable_host
    rows, all_errs, model_errs, held_out_errs = [], [], [], []
    for r in sorted(set(ev_by_regime) | set(by_regime), key=regime_label):
        pts = ev_by_regime.get(r, [])
        model = PlanMemoryModel.fit(pts)
        fit = model.law if model else None
        mbs = sorted({mb for mb, _ in pts})
        modelled = len(mbs) >= MIN_MODEL_POINTS
        lo, hi = (mbs[0], MAX_EXTRAPOLATION * mbs[-1]) if mbs else (0, 0)
        grid_fits = [g for g in by_regime.get(r, []) if g.get("outcome") == "fits" and g.get(key)
                     and lo <= g["micro_batch"] <= hi]
        grid_ooms = [g for g in by_regime.get(r, []) if g.get("outcome") == "out_of_memory"]
        errs = []
        if model:
            errs = [abs(model.predict(g["micro_batch"]) - g[key]) / g[key] for g in grid_fits]
            if modelled:
                all_errs += errs
                # Grid points at micro-batches no trial of the plan measured: predicted, not recalled.
                trial_mbs = set(mbs)
                held_out_errs += [e for e, g in zip(errs, grid_fits) if g["micro_batch"] not in trial_mbs]
                model_errs += model_range_errors(pts, by_regime.get(r, []), key)
        missed = None
        if fit and usable is not None:
            # An OOM point the model places under the usable budget would be planned as safe.
            missed = sum(1 for g in grid_ooms if model.predict(g["micro_batch"]) <= usable)
        rows.append([
            regime_label(r) + ("" if modelled else " (dropped early)"), str(len(pts)),
            ", ".join(str(mb) for mb, _ in sorted(pts)) or "–",
            "–" if not fit else f"{fit[0] / GIB:.3f} GiB + {fit[1] / MIB:.2f} MiB·mb",
            f"{len(grid_fits)} (mb {lo}–{hi})" if mbs else "0",
            pct(max(errs) if errs else None), pct(sum(errs) / len(errs) if errs else None),
            fmt(missed, "{}"),
        ])
    if rows:
        lines += table(["regime", "plan trials", "their micro-batches", "fit", "grid points judged",
                        "max error", "mean error", "grid OOMs predicted within budget"], rows)
    else:
        lines.append("Nothing to compare (no plan evidence or no grid).")
    worst = max(all_errs) if all_errs else None
    lines += ["", f"Over the modelled regimes: max {pct(worst)}, mean "
              f"{pct(sum(all_errs) / len(all_errs) if all_errs else None)} over {len(all_errs)} points — "
              f"target ≤ {TARGET_MEM_ERROR:.0%}: {verdict(None if worst is None else worst <= TARGET_MEM_ERROR)}."]
    held_worst = max(held_out_errs) if held_out_errs else None
    lines += ["", f"Of these, the {len(held_out_errs)} points at micro-batches no trial measured: max "
              f"{pct(held_worst)}, mean "
              f"{pct(sum(held_out_errs) / len(held_out_errs) if held_out_errs else None)}."]
    model_worst = max(model_errs) if model_errs else None
    lines += ["", "The law alone in its own range (fitted to the trials of at least "
              f"1/{UPPER_RANGE_DIVISOR} of the largest micro-batch, where small-batch workspaces no longer "
              "bend it; no measured floor; judged from the smallest of those trials to "
              f"{MAX_EXTRAPOLATION}× the largest): max {pct(model_worst)}, mean "
              f"{pct(sum(model_errs) / len(model_errs) if model_errs else None)} over {len(model_errs)} points — "
              f"target ≤ {TARGET_MEM_ERROR:.0%}: "
              f"{verdict(None if model_worst is None else model_worst <= TARGET_MEM_ERROR)}."]
    me = (plan or {}).get("model_error") if has_plan else None
    if me:
        lines.append(f"The plan's own leave-one-out errors: memory {pct(me.get('memory_loo_rel_error'))}, "
                     f"time {pct(me.get('time_loo_rel_error'))}.")
    lines.append("")

    # ---- (d) full run ------------------------------------------------------------------
    lines += ["## (d) Training with the plan", ""]
    ok = None
    if not run:
        lines.append("No full run recorded.")
    else:
        done = run.get("steps_done")
        want = run.get("steps_requested")
        ok = run.get("exit_code") == 0 and not run.get("oom") and (done is None or want is None or done >= want)
        with_knobs = f" with {knobs_label(run['knobs'])}" if run.get("knobs") else ""
        how = ("`autotune run` (tunes again, then trains)" if run.get("mode") == "run"
               else "`autotune train --plan`")
        lines.append(f"{how}: exit {run.get('exit_code')}, {fmt(done, '{}')} of {fmt(want, '{}')} steps in "
                     f"{fmt(run.get('wall_s'), '{:.1f}')} s, {fmt(run.get('tokens_per_s'))} tokens/s"
                     f"{with_knobs}; out of memory: {'yes' if run.get('oom') else 'no'}"
                     + ("; timed out" if run.get("timed_out") else "") + ".")
        if has_plan and run.get("knobs") and run["knobs"] != plan.get("knobs"):
            lines.append(f"(The run re-tuned and chose {knobs_label(run['knobs'])}, not the plan's "
                         f"{knobs_label(plan['knobs'])}.)")
        if not ok and run.get("stderr_tail"):
            lines += ["", "```", *run["stderr_tail"][-8:], "```"]
    lines += ["", f"Target: zero OOMs after tuning — {verdict(None if ok is None else ok)}.", ""]

    # ---- targets -------------------------------------------------------------------------
    lines += ["## Targets", ""]
    lines += table(["target", "value", "verdict"], [
        [f"plan ≥ {TARGET_PLAN_RATIO:.0%} of the grid's best feasible tokens/s", pct(ratio),
         verdict(None if ratio is None else ratio >= TARGET_PLAN_RATIO)],
        ["tune wall time below Lightning binsearch's",
         f"{fmt(tw, '{:.1f}')} s vs {fmt(lw, '{:.1f}')} s", verdict(tune_faster)],
        [f"memory model error ≤ {TARGET_MEM_ERROR:.0%} on the grid", f"max {pct(worst)}",
         verdict(None if worst is None else worst <= TARGET_MEM_ERROR)],
        [f"the law alone in its own range (mb ≥ largest/{UPPER_RANGE_DIVISOR})", f"max {pct(model_worst)}",
         verdict(None if model_worst is None else model_worst <= TARGET_MEM_ERROR)],
        ["zero OOMs training with the plan", "none" if ok else ("–" if ok is None else "failed"), verdict(ok)],
    ])
    if acc and acc.get("wall_s") is not None and tw is not None:
        lines += ["", f"(Accelerate's finder took {acc['wall_s']:.1f} s over {acc.get('trials')} trials.)"]
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("model")
    ap.add_argument("--out", help="where to write the Markdown (default OUTDIR/MODEL.summary.md; - = stdout only)")
    args = ap.parse_args()
    text = report(args.outdir, args.model)
    out = args.out or os.path.join(args.outdir, f"{args.model}.summary.md")
    if out != "-":
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    sys.stdout.buffer.write(text.encode("utf-8"))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
