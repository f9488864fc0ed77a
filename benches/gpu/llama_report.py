#!/usr/bin/env python3
"""Summary of llama_bench.sh: autotune against transformers' own decoders at the same batch,
the llama-3.2-1b tune and its training steps, and the transformers round trip.

    python3 llama_report.py OUTDIR > OUTDIR/summary.md
"""

import json
import pathlib
import sys


def lines(path):
    p = pathlib.Path(path)
    if not p.exists():
        return []
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip().startswith("{")]


def main():
    out = pathlib.Path(sys.argv[1])
    ours = {(r["model"], r["micro_batch"]): r for r in lines(out / "ours.jsonl")}
    torch = {(r["model"], r["micro_batch"]): r for r in lines(out / "torch.jsonl")}
    print("# Llama-family decoders: autotune vs transformers (PyTorch eager, SDPA, bf16 autocast)\n")
    print("| model | mb | autotune tok/s | PyTorch tok/s | speed ratio | autotune GiB | PyTorch GiB | memory ratio |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    rows = []
    for key in sorted(set(ours) | set(torch)):
        a, b = ours.get(key, {}), torch.get(key, {})
        ta, tb = a.get("tokens_per_s"), b.get("tokens_per_s")
        ma, mb_ = a.get("peak_gpu_bytes"), b.get("peak_gpu_bytes")
        sr = ta / tb if ta and tb else None
        mr = ma / mb_ if ma and mb_ else None
        g = lambda x: f"{x / 2**30:.2f}" if x else a.get("outcome", "—")
        print(f"| {key[0]} | {key[1]} | {ta or 0:,.0f} | {tb or 0:,.0f} | "
              f"{sr and f'{sr:.2f}' or '—'} | {g(ma)} | {g(mb_)} | {mr and f'{mr:.2f}' or '—'} |")
        rows.append({"model": key[0], "micro_batch": key[1], "ours_tokens_per_s": ta,
                     "torch_tokens_per_s": tb, "speed_ratio": sr, "ours_peak_bytes": ma,
                     "torch_peak_bytes": mb_, "memory_ratio": mr})
    tune = out / "tune.time"
    if tune.exists():
        t = json.loads(tune.read_text())
        print(f"\n**tune llama-3.2-1b on rtx4090-32g:** exit {t['exit']}, {t['seconds']} s")
        plan = out / "llama-3.2-1b.plan.json"
        if plan.exists():
            p = json.loads(plan.read_text())
            print(f"plan: {json.dumps(p['knobs'])}, {p['measured']['tokens_per_s']:,.0f} tok/s, "
                  f"peak {p['measured']['peak_gpu_bytes'] / 2**30:.2f} GiB")
    train = out / "train.json"
    if train.exists() and train.read_text().strip():
        t = json.loads(train.read_text())
        print(f"train with the plan: {json.dumps({k: t.get(k) for k in ('steps', 'tokens_per_s', 'last_loss', 'diverged', 'interrupted')})}")
    rt = out / "roundtrip" / "summary.json"
    if rt.exists():
        checks = json.loads(rt.read_text())["checks"]
        print("\n**transformers round trip (cuda):** " + ", ".join(
            f"{'PASS' if ok else 'FAIL'} {name}" for name, ok in checks.items()))
    (out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
