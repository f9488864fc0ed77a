#!/usr/bin/env bash
# plan_vs_grid_models.sh — a model's tuned plan on the 24 GB card against a grid of probes:
#
#   benches/gpu/plan_vs_grid_models.sh OUTDIR MODEL
#
# tune   `autotune tune --model MODEL --target rtx4090-32g --edge-trials 0 --record` →
#        OUTDIR/MODEL.{plan,profile}.json, MODEL.tune.log (its wall time in MODEL.tune_s)
# grid   `autotune probe` of bf16 without and with every block recomputed, each with the update
#        after or in backward ($REGIMES), at micro-batches $MBS and the plan's own, each in a
#        fresh process on the card held to 24564 MiB, a regime stopping at its first
#        out-of-memory → OUTDIR/MODEL.grid.jsonl (STAGES=grid skips the tune and reads the plan
#        already in OUTDIR)
# then OUTDIR/MODEL.summary.json: every probe, the best within the plan's headroom, and the
# plan's setting's tokens/s (probed like the rest) over it.
#
# Needs the CUDA build in .gpu/. Environment: MBS ("1 2 4 8 16 24 32 48 64"), REGIMES
# ("none:after-backward none:in-backward all:after-backward all:in-backward"), STAGES
# ("tune grid"), TUNE_TIMEOUT (300), PYTHON.
set -uo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -lt 2 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"
MODEL="$2"
MBS="${MBS:-1 2 4 8 16 24 32 48 64}"
REGIMES="${REGIMES:-none:after-backward none:in-backward all:after-backward all:in-backward}"
STAGES="${STAGES:-tune grid}"
TUNE_TIMEOUT="${TUNE_TIMEOUT:-300}"
BIN="$GPU_DIR/autotune"
need_bin "build it with cuda-build.sh --out $GPU_DIR --bin autotune"
gpu_libraries "$GPU_DIR" wheels
record_header > "$OUTDIR/env.txt"
gpu_line >> "$OUTDIR/env.txt"

if wants tune; then
  say "tune: $MODEL on rtx4090-32g"
  T0="$(date +%s.%N)"
  bounded "$TUNE_TIMEOUT" "$BIN" tune --model "$MODEL" --target rtx4090-32g \
    --edge-trials 0 --record "$OUTDIR/$MODEL.profile.json" \
    --out "$OUTDIR/$MODEL.plan.json" > /dev/null 2> "$OUTDIR/$MODEL.tune.log"
  say "  exit $?"
  "$PYTHON" -c "import sys; print(float(sys.argv[1]) - float(sys.argv[2]))" \
    "$(date +%s.%N)" "$T0" > "$OUTDIR/$MODEL.tune_s"
  grep -E '^\[|plan:' "$OUTDIR/$MODEL.tune.log" | tail -14 >&2
fi

plan_field() {
  "$PYTHON" -c "
import json, sys
k = json.load(open(sys.argv[1]))['knobs']
ckpt = 'none' if k['checkpointing']['mode'] == 'none' else 'all'
update = k.get('update', 'after_backward').replace('_', '-')
print(k['micro_batch'] if sys.argv[2] == 'mb' else f'{ckpt}:{update}')
" "$OUTDIR/$MODEL.plan.json" "$1" 2>/dev/null
}
PLAN_MB="$(plan_field mb)"
PLAN_REGIME="$(plan_field regime)"
: >> "$OUTDIR/$MODEL.grid.jsonl"
probe() {
  local regime="$1" mb="$2" ckpt="${1%%:*}" update="${1##*:}"
  timeout --kill-after=10 120 "$BIN" probe --model "$MODEL" --precision bf16 \
    --checkpointing "$ckpt" --update "$update" --micro-batch "$mb" --warmup 1 --steps 3 \
    --gpu-capacity 24564MiB --device cuda --json 2>> "$OUTDIR/$MODEL.grid.log" | grep '^{' \
    | "$PYTHON" -c "
import json, sys
for line in sys.stdin:
    d = json.loads(line); d['micro_batch'] = $mb; d['regime'] = '$regime'; print(json.dumps(d))" \
    >> "$OUTDIR/$MODEL.grid.jsonl"
  say "  $regime mb $mb: $(tail -n1 "$OUTDIR/$MODEL.grid.jsonl" | grep -o '"tokens_per_s": [0-9.]*\|out_of_memory' | head -1)"
  tail -n1 "$OUTDIR/$MODEL.grid.jsonl" | grep -q '"fits"'
}
if wants grid; then
  for regime in $REGIMES; do
    list="$MBS"
    if [[ "$regime" == "$PLAN_REGIME" && -n "$PLAN_MB" ]]; then
      list="$(printf '%s\n' $MBS "$PLAN_MB" | sort -n | uniq | tr '\n' ' ')"
    fi
    for mb in $list; do
      probe "$regime" "$mb" || break
    done
  done
fi

"$PYTHON" - "$OUTDIR" "$MODEL" <<'PY' > "$OUTDIR/$MODEL.summary.json"
import json, pathlib, sys
out, model = pathlib.Path(sys.argv[1]), sys.argv[2]
usable = 0.95 * 24564 * 2**20  # the plan's budget: the 4090's 24564 MiB less its 5 % headroom
rows = [json.loads(l) for l in (out / f"{model}.grid.jsonl").read_text().splitlines() if l.strip()]
def m(r): return r.get("measurement") or r
def fits(r): return r.get("outcome", "fits") == "fits" and (m(r).get("peak_gpu_bytes") or 0) <= usable
def regime(r):
    # Rows written before the update was part of the grid: after backward.
    return r.get("regime") or (r["checkpointing"] + ":after-backward")
grid = [{"regime": regime(r), "micro_batch": r["micro_batch"],
         "outcome": r.get("outcome", "fits"), "fits_headroom": fits(r),
         "tokens_per_s": m(r).get("tokens_per_s"), "peak_gpu_bytes": m(r).get("peak_gpu_bytes")}
        for r in rows]
feasible = [g for g in grid if g["fits_headroom"]]
best = max(feasible, key=lambda g: g["tokens_per_s"], default=None)
summary = {"model": model, "grid": grid, "best": best,
           "tune_s": float((out / f"{model}.tune_s").read_text() or 0)}
plan_path = out / f"{model}.plan.json"
if plan_path.exists() and best:
    plan = json.loads(plan_path.read_text())
    k = plan["knobs"]
    ckpt = "none" if k["checkpointing"]["mode"] == "none" else "all"
    planned = ckpt + ":" + k.get("update", "after_backward").replace("_", "-")
    summary["plan"] = {"micro_batch": k["micro_batch"], "regime": planned,
                       "tokens_per_s_measured": plan["measured"]["tokens_per_s"],
                       "tokens_per_s_interval": plan.get("tokens_per_s_interval"),
                       "trials": len(plan["evidence"]),
                       "remeasured": sum(1 for e in plan["evidence"] if e["request"].get("remeasure"))}
    same = [g for g in grid if g["micro_batch"] == k["micro_batch"] and g["regime"] == planned
            and g["fits_headroom"]]
    if same:
        summary["plan_vs_best"] = same[0]["tokens_per_s"] / best["tokens_per_s"]
print(json.dumps(summary, indent=1))
PY
cat "$OUTDIR/$MODEL.summary.json" >&2
say "done"
