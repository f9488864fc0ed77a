#!/usr/bin/env bash
# plan_vs_grid.sh — llama-3.1-8b's tuned plan on the 24 GB card against every batch probed:
#
#   benches/gpu/plan_vs_grid.sh OUTDIR [STAGE ...]
#
# Stages (default: tune grid):
#   tune   `autotune tune --model llama-3.1-8b --target rtx4090-32g --allow-compact-state
#          --record` → OUTDIR/8b.{plan,profile}.json, tune.log (a fresh recording of the search)
#   grid   `autotune probe` of the plan's regime (bf16, every block recomputed, the update in
#          backward, 8-bit moments in host memory, bf16 masters rounded stochastically) at
#          micro-batches $MBS, each in a fresh process on the card held to 24564 MiB →
#          OUTDIR/grid.jsonl
# then OUTDIR/summary.json: each batch's tokens/s and peak, the best one within the plan's
# headroom, and the plan's batch's tokens/s over it (all from the probes, on this machine's
# host link).
#
# Needs the CUDA build in .gpu/. Environment: MBS ("1 2 3 4 5 6 7 8"), TUNE_TIMEOUT (330), PYTHON.
set -uo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -lt 1 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"
shift
STAGES="${*:-tune grid}"
MBS="${MBS:-1 2 3 4 5 6 7 8}"
TUNE_TIMEOUT="${TUNE_TIMEOUT:-330}"
BIN="$GPU_DIR/autotune"
need_bin "build it with cuda-build.sh --out $GPU_DIR --bin autotune"
gpu_libraries "$GPU_DIR" wheels
record_header > "$OUTDIR/env.txt"
gpu_line >> "$OUTDIR/env.txt"
COMPACT=(--precision bf16 --checkpointing all --update in-backward --moments int8
  --masters bf16-sr --moments-on host)

if wants tune; then
  say "tune: llama-3.1-8b on rtx4090-32g with compact state"
  bounded "$TUNE_TIMEOUT" "$BIN" tune --model llama-3.1-8b --target rtx4090-32g \
    --allow-compact-state --edge-trials 0 --record "$OUTDIR/8b.profile.json" \
    --out "$OUTDIR/8b.plan.json" > /dev/null 2> "$OUTDIR/tune.log"
  say "  exit $?"
  grep -E '^\[|plan:' "$OUTDIR/tune.log" | tail -12 >&2
fi

if wants grid; then
  : > "$OUTDIR/grid.jsonl"
  for mb in $MBS; do
    say "grid: micro-batch $mb"
    timeout --kill-after=10 200 "$BIN" probe --model llama-3.1-8b "${COMPACT[@]}" \
      --micro-batch "$mb" --warmup 1 --steps 3 --gpu-capacity 24564MiB --device cuda --json \
      2>> "$OUTDIR/grid.log" | grep '^{' | "$PYTHON" -c "
import json, sys
for line in sys.stdin:
    d = json.loads(line); d['micro_batch'] = $mb; print(json.dumps(d))" >> "$OUTDIR/grid.jsonl"
    say "  $(tail -c 300 "$OUTDIR/grid.jsonl")"
  done
fi

"$PYTHON" - "$OUTDIR" <<'PY' > "$OUTDIR/summary.json"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
usable = 0.95 * 24564 * 2**20  # the plan's budget: the 4090's 24564 MiB less its 5 % headroom
rows = [json.loads(l) for l in (out / "grid.jsonl").read_text().splitlines() if l.strip()]
def fits(r):
    m = r.get("measurement") or r
    return r.get("outcome", "fits") == "fits" and (m.get("peak_gpu_bytes") or 0) <= usable
def tps(r):
    m = r.get("measurement") or r
    return m.get("tokens_per_s") or 0.0
grid = {r["micro_batch"]: {"fits_headroom": fits(r), "tokens_per_s": tps(r) if fits(r) else None,
        "peak_gpu_bytes": (r.get("measurement") or r).get("peak_gpu_bytes"),
        "outcome": r.get("outcome", "fits")} for r in rows}
best = max((b for b in grid if grid[b]["fits_headroom"]), key=lambda b: grid[b]["tokens_per_s"], default=None)
plan = json.loads((out / "8b.plan.json").read_text()) if (out / "8b.plan.json").exists() else None
summary = {"grid": grid, "best_micro_batch": best}
if plan and best:
    mb = plan["knobs"]["micro_batch"]
    summary["plan_micro_batch"] = mb
    if grid.get(mb, {}).get("tokens_per_s"):
        summary["plan_vs_best"] = grid[mb]["tokens_per_s"] / grid[best]["tokens_per_s"]
print(json.dumps(summary, indent=1))
PY
cat "$OUTDIR/summary.json" >&2
say "done"
