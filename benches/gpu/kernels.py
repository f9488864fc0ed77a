"""Summarise Nsight Compute's raw CSV (gpu__time_duration.sum per kernel) per name and kind.

    python3 kernels.py KERNELS.csv STEPS

Prints a Markdown table of the kernels that take the most time, per optimizer step.
"""
import collections
import csv
import sys


def kind(name):
    n = name.lower()
    if any(k in n for k in ("gemm", "cutlass", "sm90", "sm80", "xmma", "cublas", "nvjet")):
        return "matrix product"
    if n.startswith(("ucopy", "copy")) or "copy" in n:
        return "copy / cast"
    if any(k in n for k in ("cast_",)):
        return "copy / cast"
    if any(k in n for k in ("reduce", "fast_sum", "fast_max", "fast_min", "sum_", "argmax")):
        return "reduction"
    if any(k in n for k in ("ce_fwd", "ce_bwd", "ln_", "softmax_fwd", "softmax_bwd", "epilogue_",
                            "flash_", "swiglu_", "rotary_",
                            "embed_fwd", "embed_grad", "permute_b", "adam_")):
        return "ours (src/ops/kernels)"
    if any(k in n for k in ("curand", "generate", "uniform", "rand")):
        return "random"
    if any(k in n for k in ("index_select", "gather", "scatter", "index_add", "where")):
        return "index"
    return "elementwise / other"


def read_rows(path):
    """(kernel name, nanoseconds) per profiled launch, in launch order. ncu's own `==PROF==`
    lines and whatever the profiled program printed share the file: only CSV lines (those that
    start with a quote) are read."""
    rows = []
    with open(path, newline="", errors="replace") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        value = r.get("gpu__time_duration.sum") or ""
        try:
            ns = float(value.replace(",", ""))
        except ValueError:
            continue  # the units row
        rows.append((r.get("Kernel Name") or "?", ns))
    return rows


def main():
    path, steps = sys.argv[1], int(sys.argv[2])
    rows = read_rows(path)
    if not rows:
        print(f"no kernel rows in {path}")
        return
    total = sum(ns for _, ns in rows)
    by_name = collections.defaultdict(lambda: [0.0, 0])
    by_kind = collections.defaultdict(lambda: [0.0, 0])
    for name, ns in rows:
        short = name.split("(")[0][:70]
        by_name[short][0] += ns
        by_name[short][1] += 1
        by_kind[kind(name)][0] += ns
        by_kind[kind(name)][1] += 1
    ms = lambda ns: ns / steps / 1e6
    print(f"{len(rows)} kernels over {steps} steps: {ms(total):.1f} ms of kernel time per step\n")
    print("| kind | ms/step | share | launches/step |\n|---|--:|--:|--:|")
    for k, (ns, c) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"| {k} | {ms(ns):.2f} | {ns / total:.1%} | {c / steps:.0f} |")
    print("\n| kernel | ms/step | share | launches/step | µs/launch |\n|---|--:|--:|--:|--:|")
    for name, (ns, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:40]:
        print(f"| `{name}` | {ms(ns):.2f} | {ns / total:.1%} | {c / steps:.0f} | {ns / c / 1e3:.1f} |")


if __name__ == "__main__":
    main()
