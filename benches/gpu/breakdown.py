#!/usr/bin/env python3
"""Where one optimizer step's time goes: the GPU time of every kernel (Nsight Compute's raw
CSV, gpu__time_duration.sum per launch) summed per class, against the step's wall-clock time
measured in a run without the profiler; what is left of the wall step is idle gaps.

    python3 breakdown.py side --name ours --ncu SHORT.csv 2 --ncu LONG.csv 4 \\
        --run-json PROBE.json [--metrics TRAIN.jsonl --skip 4] \\
        [--gemm-shapes GEMM.json --gemm-layout fused] [--json OUT.json]
    python3 breakdown.py join OURS.json PYTORCH.json [--json OUT.json]

`side` prints one implementation's breakdown as Markdown (and writes it as JSON with --json);
`join` puts the JSON of several side by side. Standard library only.

Per step: given two profiled runs of S1 < S2 steps, each kernel's time is (run S2 - run S1) /
(S2 - S1), so that what runs once (weight initialisation, the check of the weights, the first
steps' setup, the end of the run) drops out; given one run of S steps, its total / S, one-off
kernels included.

The wall step is the median of a `train --metrics` file's steps after --skip (each step's
tokens over its tokens/s), else `step_time_median_s` of the run's JSON line (`autotune probe
--json`, torch_ref.py, llama_ref.py). N (parameters) and tokens per step come from that line
(params; micro_batch x seq_len x grad_accum) unless --params / --tokens-per-step are given; the
output says which. MFU counts 6 N FLOPs per token against --peak-flops (default 989e12, H100
SXM dense bf16).

Idle gaps = wall step - kernel time per step, never below 0. Shares are of the wall step, or of
the kernel time where that is the larger (the profiler serialises kernels and can stretch them):
they are never negative and add up to 100 %.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import read_rows  # noqa: E402

CLASSES = ("GEMM", "attention", "norms and elementwise", "loss head", "optimizer",
           "copies and casts", "other")
IDLE = "idle gaps"
PEAK_FLOPS = 989e12

# First match wins, on the lower-cased name. The order matters: PyTorch's flash and efficient
# attention kernels carry `cutlass` in their template arguments and cuDNN's attention `sm90`
# and `wgmma`, so attention is tried before GEMM; log-softmax (the loss) before softmax
# (attention); the specific norm, random, index and reduction names before the generic
# `elementwise` kernels that carry many of them (`distribution_elementwise_...` is the random
# initialisation, `index_elementwise_kernel` an index op).
_RULES = [
    ("loss head", r"(^|[^a-z])ce_(fwd|bwd)|cross_?entropy|nll_loss|log_?softmax"),
    ("attention", r"flash|fmha|sdpa|attention|dot_do_o|convert_dq|softmax"),
    ("optimizer", r"adam|multi_tensor_apply|foreach|l2norm|amp_update_scale"),
    ("GEMM", r"gemm|gemv|cutlass|xmma|cublas|nvjet|(^|[^a-z0-9])sm\d{2,3}_|"
             r"(ampere|hopper|turing|volta)_"),
    ("norms and elementwise", r"(^|[^a-z])ln_|layer_?norm|rms_?norm|gammabeta|rowwisemoments|"
                              r"epilogue|swiglu|gelu|silu|rotary|(^|[^a-z])rope|dropout"),
    ("other", r"curand|philox|distribution_|uniform|normal_|randperm|embed|index|gather|"
              r"scatter|reduce|(^|[^a-z_])(fast_)?(sum|min|max|argmin|argmax)_|cub::|sort|"
              r"segment"),
    ("copies and casts", r"copy|(^|[^a-z])cast_|widen_|accumulate_|permute|transpose|fill|"
                         r"const_set|memset|memcpy"),
    ("norms and elementwise", r"elementwise|functor|(^|[^a-z])b(add|sub|mul|div|minimum|"
                              r"maximum)_|(^|[^a-z])u(neg|exp|log|abs|sqr|sqrt|gelu|erf|relu|"
                              r"silu|tanh|recip|sign|sin|cos)_|affine_|powf_|where_|clamp|"
                              r"sigmoid|rsqrt|"
                              # Inductor's fused pointwise, reduction and persistent-reduction
                              # kernels (torch.compile), once no rule above named their ops.
                              r"(^|[^a-z])triton_(poi|red|per)_"),
]
RULES = [(cls, re.compile(pattern)) for cls, pattern in _RULES]


def classify(name):
    """The class of a kernel by its name (demangled, as ncu prints it)."""
    low = name.lower()
    for cls, pattern in RULES:
        if pattern.search(low):
            return cls
    return "other"


def short_name(name, width=90):
    """The kernel's name without `void`, its argument list and past `width` characters."""
    name = name.replace("(anonymous namespace)", "<unnamed>")
    if name.startswith("void "):
        name = name[5:]
    depth = 0
    for i, ch in enumerate(name):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            name = name[:i]
            break
    return name if len(name) <= width else name[:width - 1] + "…"


# ---- kernel time per step -------------------------------------------------------------------

def totals(rows):
    """{name: [nanoseconds, launches]} over the rows of one profiled run."""
    out = collections.defaultdict(lambda: [0.0, 0])
    for name, ns in rows:
        out[name][0] += ns
        out[name][1] += 1
    return out


def per_step(runs):
    """{name: (ns per step, launches per step)} from [(rows, steps)]: one run, or two whose
    difference is taken (the one with fewer steps first or not)."""
    if len(runs) == 1:
        (rows, steps), = runs
        return {n: (ns / steps, c / steps) for n, (ns, c) in totals(rows).items()}
    (short, s1), (long_, s2) = sorted(runs, key=lambda r: r[1])
    if s2 == s1:
        raise ValueError("the two profiled runs must have different step counts")
    a, b = totals(short), totals(long_)
    return {n: ((b.get(n, [0, 0])[0] - a.get(n, [0, 0])[0]) / (s2 - s1),
                (b.get(n, [0, 0])[1] - a.get(n, [0, 0])[1]) / (s2 - s1))
            for n in set(a) | set(b)}


def by_class(kernels):
    """{class: [ns, launches]} per step for every class; a class that comes out below zero (the
    timing noise of two runs' difference) counts as zero."""
    out = {cls: [0.0, 0.0] for cls in CLASSES}
    for name, (ns, count) in kernels.items():
        cls = classify(name)
        out[cls][0] += ns
        out[cls][1] += count
    for cls in out:
        out[cls] = [max(0.0, out[cls][0]), max(0.0, out[cls][1])]
    return out


def shares(class_ms, wall_ms):
    """(idle ms, denominator ms, {class: share}) with idle = wall - kernel time (>= 0) and the
    shares of max(wall, kernel time): each >= 0, adding up to 1."""
    kernel_ms = sum(class_ms.values())
    idle = max(0.0, wall_ms - kernel_ms)
    denominator = max(wall_ms, kernel_ms)
    parts = dict(class_ms, **{IDLE: idle})
    if denominator <= 0:
        return idle, denominator, {k: 0.0 for k in parts}
    return idle, denominator, {k: v / denominator for k, v in parts.items()}


# ---- the run's facts --------------------------------------------------------------------------

def last_json_line(path):
    """The last line of a file that parses as a JSON object; None when there is none."""
    found = None
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    found = json.loads(line)
                except json.JSONDecodeError:
                    pass
    return found


def tokens_of(record):
    """Tokens per optimizer step of a probe/reference line, or None."""
    mb, seq = record.get("micro_batch"), record.get("seq_len")
    if not mb or not seq:
        return None
    accum = ((record.get("request") or {}).get("knobs") or {}).get("grad_accum") or 1
    return mb * seq * accum


def metrics_wall_s(path, skip, tokens):
    """(median step seconds, steps counted, first counted step) of a `train --metrics` file:
    each step's tokens over its tokens/s, the first `skip` steps left out."""
    steps = []
    with open(path, errors="replace") as f:
        for line in f:
            if line.strip().startswith("{"):
                steps.append(json.loads(line))
    kept = [s for s in steps[skip:] if s.get("tokens_per_s")]
    if not kept:
        raise ValueError(f"{path}: no step after the first {skip}")
    return statistics.median(tokens / s["tokens_per_s"] for s in kept), len(kept), kept[0].get("step")


def facts(args):
    """The wall step, N and tokens per step, each with where it came from."""
    record = last_json_line(args.run_json) if args.run_json else None
    if args.run_json and record is None:
        raise ValueError(f"{args.run_json}: no JSON line")
    record = record or {}
    base = os.path.basename(args.run_json or "")
    f = {"record": record}
    f["params"], f["params_source"] = pick(args.params, "--params", record.get("params"),
                                           f"params of {base}")
    f["tokens"], f["tokens_source"] = pick(args.tokens_per_step, "--tokens-per-step",
                                           tokens_of(record), f"micro_batch × seq_len of {base}")
    run_s = record.get("step_time_median_s")
    f["run_json_wall_ms"] = run_s * 1e3 if run_s else None
    if args.metrics:
        if not f["tokens"]:
            raise ValueError("--metrics needs the tokens per step (--run-json or --tokens-per-step)")
        median, n, first = metrics_wall_s(args.metrics, args.skip, f["tokens"])
        f["wall_ms"] = median * 1e3
        f["wall_source"] = (f"median of {n} steps of train --metrics from step {first} on, "
                            f"{os.path.basename(args.metrics)}")
    elif run_s:
        f["wall_ms"] = run_s * 1e3
        f["wall_source"] = f"step_time_median_s of {base}"
    else:
        raise ValueError("no wall step: give --metrics or a --run-json with step_time_median_s")
    return f


def pick(given, given_source, found, found_source):
    """The value given on the command line, else the one found in the run's JSON."""
    if given:
        return given, given_source
    if found:
        return found, found_source
    return None, "unknown"


# ---- GEMMs against cuBLAS -----------------------------------------------------------------------

def gemm_comparison(path, layout, gemm_ms, tokens):
    """Our GEMM time against gemm_shapes.py's cuBLAS time for the step's products."""
    with open(path) as f:
        doc = json.load(f)
    layouts = doc.get("layouts") or {}
    name = layout or next(iter(layouts), None)
    entry = layouts.get(name)
    if not entry:
        raise ValueError(f"{path}: no layout {name!r} (has {', '.join(layouts) or 'none'})")
    flops, cublas_ms = entry["flops_per_step"], entry.get("cublas_ms_per_step")
    out = {"source": os.path.basename(path), "layout": name, "flops_per_step": flops,
           "cublas_ms": cublas_ms, "ours_ms": gemm_ms,
           "tokens_per_step": doc.get("tokens_per_step"), "tokens_match": None,
           "at_cublas": None, "achieved_tflops": None, "cublas_tflops": None}
    if tokens and doc.get("tokens_per_step"):
        out["tokens_match"] = doc["tokens_per_step"] == tokens
    if gemm_ms > 0:
        out["achieved_tflops"] = flops / (gemm_ms / 1e3) / 1e12
        if cublas_ms:
            out["at_cublas"] = cublas_ms / gemm_ms
    if cublas_ms:
        out["cublas_tflops"] = flops / (cublas_ms / 1e3) / 1e12
    return out


# ---- one side -------------------------------------------------------------------------------------

def side(args):
    """One implementation's breakdown as a JSON-ready dict."""
    if len(args.ncu) > 2 or any(not s.isdigit() or int(s) < 1 for _, s in args.ncu):
        raise ValueError("give one or two --ncu CSV STEPS, STEPS a number from 1")
    runs = [(read_rows(path), int(steps)) for path, steps in args.ncu]
    for (rows, _), (path, _) in zip(runs, args.ncu):
        if not rows:
            raise ValueError(f"{path}: no kernel rows (did ncu run? see its .log)")
    kernels = per_step(runs)
    classes = by_class(kernels)
    f = facts(args)
    class_ms = {cls: ns / 1e6 for cls, (ns, _) in classes.items()}
    idle, denominator, share = shares(class_ms, f["wall_ms"])
    kernel_ms = sum(class_ms.values())
    result = {
        "name": args.name, "model": f["record"].get("model"),
        "precision": f["record"].get("precision"), "micro_batch": f["record"].get("micro_batch"),
        "method": method(args.ncu), "wall_ms": f["wall_ms"], "wall_source": f["wall_source"],
        "run_json_wall_ms": f["run_json_wall_ms"], "kernel_ms": kernel_ms, "idle_ms": idle,
        "over_wall_ms": max(0.0, kernel_ms - f["wall_ms"]), "share_of_ms": denominator,
        "launches": sum(c for _, c in classes.values()),
        "classes": {cls: {"ms": class_ms[cls], "share": share[cls], "launches": classes[cls][1]}
                    for cls in CLASSES},
        "params": f["params"], "params_source": f["params_source"],
        "tokens_per_step": f["tokens"], "tokens_source": f["tokens_source"],
        "peak_flops": args.peak_flops, "top_kernels": top_kernels(kernels, kernel_ms, args.top),
    }
    result["classes"][IDLE] = {"ms": idle, "share": share[IDLE], "launches": None}
    result.update(throughput(f["tokens"], f["params"], f["wall_ms"], args.peak_flops))
    result["gemm"] = (gemm_comparison(args.gemm_shapes, args.gemm_layout, class_ms["GEMM"],
                                      f["tokens"]) if args.gemm_shapes else None)
    return result


def method(ncu):
    """How the kernel time per step was had, in words."""
    if len(ncu) == 1:
        steps = int(ncu[0][1])
        return f"one profiled run of {steps} step{'s' * (steps != 1)}, one-off kernels included"
    s1, s2 = sorted(int(steps) for _, steps in ncu)
    return f"the {s2}-step profiled run less the {s1}-step one, over {s2 - s1} steps"


def throughput(tokens, params, wall_ms, peak):
    """tokens/s and MFU (6 N FLOPs per token against `peak`), None where unknown."""
    tps = tokens / (wall_ms / 1e3) if tokens and wall_ms > 0 else None
    mfu = 6 * params * tps / peak if tps and params else None
    return {"tokens_per_s": tps, "mfu": mfu}


def top_kernels(kernels, kernel_ms, top):
    """The `top` kernels by time per step, those above zero."""
    ranked = sorted(((ns, c, n) for n, (ns, c) in kernels.items() if ns > 0), reverse=True)
    return [{"name": short_name(n), "class": classify(n), "ms": ns / 1e6,
             "share_of_kernels": ns / 1e6 / kernel_ms if kernel_ms else 0.0,
             "launches": c, "us_per_launch": ns / c / 1e3 if c > 0 else None}
            for ns, c, n in ranked[:top]]


# ---- Markdown -----------------------------------------------------------------------------------

def num(value, fmt, none="–"):
    return none if value is None else format(value, fmt)


def count(launches):
    """Launches per step: whole numbers as such, a one-off kernel's fraction as one."""
    if launches is None:
        return ""
    return f"{launches:.0f}" if launches >= 10 or launches == int(launches) else f"{launches:.2f}"


def title(r):
    parts = [r.get("model"), r.get("precision"),
             f"micro-batch {r['micro_batch']}" if r.get("micro_batch") else None]
    return " ".join(p for p in parts if p)


def render_side(r):
    """One side's breakdown: the step, the class table, the GEMMs, the top kernels."""
    lines = [f"## {r['name']}: {title(r)}", ""]
    lines += summary_lines(r)
    lines += ["", "| class | ms/step | share | launches/step |", "|---|--:|--:|--:|"]
    for cls in CLASSES + (IDLE,):
        c = r["classes"][cls]
        lines.append(f"| {cls} | {c['ms']:.2f} | {c['share']:.1%} | {count(c['launches'])} |")
    lines.append(f"| **wall step** | **{r['wall_ms']:.2f}** | | |")
    if r["over_wall_ms"] > 0:
        lines += ["", f"Kernel time exceeds the wall step by {r['over_wall_ms']:.2f} ms (the "
                  "profiler serialises kernels): shares are of the kernel time, idle gaps 0."]
    lines += gemm_lines(r.get("gemm"))
    lines += ["", "| kernel | class | ms/step | share of kernels | launches/step | µs/launch |",
              "|---|---|--:|--:|--:|--:|"]
    for k in r["top_kernels"]:
        lines.append(f"| `{k['name']}` | {k['class']} | {k['ms']:.2f} | "
                     f"{k['share_of_kernels']:.1%} | {count(k['launches'])} | "
                     f"{num(k['us_per_launch'], '.1f')} |")
    return "\n".join(lines) + "\n"


def summary_lines(r):
    out = [f"- wall step {r['wall_ms']:.2f} ms ({r['wall_source']})"]
    if r.get("run_json_wall_ms") and "metrics" in r["wall_source"]:
        out.append(f"- the run's own JSON line gave {r['run_json_wall_ms']:.2f} ms")
    out.append(f"- kernel time {r['kernel_ms']:.2f} ms per step, {r['launches']:.0f} launches "
               f"({r['method']}); idle gaps {r['idle_ms']:.2f} ms")
    out.append(f"- {num(r['tokens_per_s'], ',.0f')} tokens/s: {num(r['tokens_per_step'], ',d')} "
               f"tokens per step ({r['tokens_source']})")
    out.append(f"- MFU {num(r['mfu'], '.1%')}: 6 · N · tokens/s over "
               f"{r['peak_flops'] / 1e12:.0f} TFLOP/s, N = {num(r['params'], ',d')} "
               f"({r['params_source']})")
    return out


def gemm_lines(g):
    if not g:
        return []
    out = ["", f"GEMMs: {g['flops_per_step'] / 1e12:.2f} TFLOP per step ({g['source']}, "
               f"{g['layout']} layout). cuBLAS alone at these shapes: "
               f"{num(g['cublas_ms'], '.2f')} ms ({num(g['cublas_tflops'], '.0f')} TFLOP/s); "
               f"these GEMMs: {g['ours_ms']:.2f} ms ({num(g['achieved_tflops'], '.0f')} TFLOP/s)"
               f", **at {num(g['at_cublas'], '.1%')} of cuBLAS's best for these shapes**."]
    if g.get("tokens_match") is False:
        out.append(f"(The shapes were for {g['tokens_per_step']} tokens per step, not this run's.)")
    return out


def render_join(sides):
    """Several sides next to each other, then each side's own breakdown."""
    names = [s["name"] for s in sides]
    lines = [f"# Where a {title(sides[0])} step goes", "",
             "| | " + " | ".join(f"{n} ms | {n} share" for n in names) + " |",
             "|---|" + "--:|--:|" * len(sides)]
    for cls in CLASSES + (IDLE,):
        lines.append(joined_row(cls, sides, lambda s, c=cls: (
            f"{s['classes'][c]['ms']:.2f}", f"{s['classes'][c]['share']:.1%}")))
    gemm = lambda s, key: (s.get("gemm") or {}).get(key)  # noqa: E731
    lines += [
        joined_row("**wall step**", sides, lambda s: (f"**{s['wall_ms']:.2f}**", "")),
        joined_row("kernel time", sides, lambda s: (f"{s['kernel_ms']:.2f}", "")),
        joined_row("tokens/s", sides, lambda s: (num(s["tokens_per_s"], ",.0f"), "")),
        joined_row("MFU (6·N)", sides, lambda s: ("", num(s["mfu"], ".1%"))),
        joined_row("GEMMs, share of cuBLAS's speed", sides,
                   lambda s: ("", num(gemm(s, "at_cublas"), ".1%"))),
        joined_row("GEMM TFLOP/s achieved", sides,
                   lambda s: (num(gemm(s, "achieved_tflops"), ".0f"), "")),
        "",
    ]
    return "\n".join(lines) + "\n" + "\n".join(render_side(s) for s in sides)


def joined_row(label, sides, cells):
    """A row of the joined table: two cells (the ms and the share column) per side."""
    return f"| {label} | " + " | ".join(" | ".join(cells(s)) for s in sides) + " |"


# ---- command line -------------------------------------------------------------------------------

def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("side", help="one implementation's breakdown")
    s.add_argument("--name", required=True, help="what to call it (ours, pytorch)")
    s.add_argument("--ncu", nargs=2, action="append", required=True, metavar=("CSV", "STEPS"),
                   help="a profiled run and its optimizer steps; give two to take their difference")
    s.add_argument("--run-json", help="the run's JSON line: autotune probe --json, torch_ref.py, llama_ref.py")
    s.add_argument("--metrics", help="a train --metrics file: the wall step from its steps")
    s.add_argument("--skip", type=int, default=4, help="warm-up steps of --metrics to leave out")
    s.add_argument("--params", type=int, help="N, the model's parameters")
    s.add_argument("--tokens-per-step", type=int, help="tokens per optimizer step")
    s.add_argument("--peak-flops", type=float, default=PEAK_FLOPS)
    s.add_argument("--gemm-shapes", help="gemm_shapes.py's JSON for the same model and batch")
    s.add_argument("--gemm-layout", help="which of its layouts (default: its first)")
    s.add_argument("--top", type=int, default=25, help="kernels in the by-name table")
    s.add_argument("--json", help="write the breakdown here as JSON")
    j = sub.add_parser("join", help="side breakdowns (JSON) next to each other")
    j.add_argument("sides", nargs="+")
    j.add_argument("--json", help="write them here as one JSON document")
    return ap.parse_args(argv)


def write_json(path, doc):
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


def main(argv=None):
    args = parse(argv)
    try:
        if args.command == "side":
            result = side(args)
            write_json(args.json, result)
            print(render_side(result), end="")
        else:
            sides = []
            for path in args.sides:
                with open(path) as f:
                    sides.append(json.load(f))
            write_json(args.json, {"sides": sides})
            print(render_join(sides), end="")
    except (OSError, ValueError, KeyError) as e:
        print(f"breakdown.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
