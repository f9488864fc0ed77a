#!/usr/bin/env bash
# issue3_bench.sh — the tune bench of issue 3 in one call: seed, then gpt-124m, each through
# tune_bench.sh on the emulated RTX 4090 (24564 MiB + 32 GiB host). About 6–7 minutes on an
# H200 with the PTX JIT cache warm, at most 8 (the two budgets below).
#
#   benches/gpu/issue3_bench.sh OUTDIR
#
# Per model, tune_bench.sh runs (see its header):
#   warm-up  tiny probes per precision, untimed (fill the PTX JIT cache: ~20 s on a fresh machine)
#   tune     `autotune tune -v --record OUTDIR/MODEL.profile.json`, wall clock timed; -v logs
#            each trial's phases (setup, steps, evaluation, checkpoint dry run) for the report
#   finders  Lightning's binsearch finder and Accelerate's finder on the same model and cap
#   run      `autotune train --plan` for RUN_STEPS steps: does the plan train without OOM?
#   grid     `autotune probe` per regime: plain and checkpointing by the doubling schedule and
#            the eighths below the first OOM (enough to judge "≥ 98 % of the best" and the
#            memory model's error); the two offloaded regimes only at micro-batch 1 and near
#            their boundary (OFFLOAD_POINTS): their host-side optimizer costs ~0.45 s per
#            gpt-124m step, so a doubling grid would take minutes to show what two points show
#            (they run at a fraction of the plan's tokens/s), and tune models neither of them
#   report   tune_report.py → OUTDIR/MODEL.summary.md
# then OUTDIR/issue3-summary.md: the machine, the commit, and each model's search-cost and
# targets tables.
#
# Expected wall time per stage on the H200 (the budget of each model caps its stages; the grid
# takes what the others leave):
#   seed      budget 150 s: warm-up 2 s, tune ~6 s, finders ~50 s, train ~5 s, grid ≤ 60 s
#   gpt-124m  budget 330 s: warm-up 2 s, tune ~35–45 s, finders ~70 s, train ~15 s, grid ≤ 170 s
#
# Environment (optional; anything else tune_bench.sh reads passes through, e.g. BIN, PYTHON):
#   MODELS           models to run (default "seed gpt-124m")
#   SEED_SECONDS, GPT_SECONDS   per-model budgets (default 150, 330)
#   EXTRA_TUNE_ARGS  appended to tune's arguments (e.g. "--max-micro-batch 16" for a dry run)
#   OFFLOAD_POINTS   grid micro-batches of the offloaded regimes, "PLAIN CKPT" (default
#                    "1,48 1,88" for gpt-124m, "1,1024 1,1024" for seed)
#   DEVICE           target profile (default rtx4090-32g; `cpu` for a CPU dry run, which also
#                    leaves the grid to the CPU's regimes)
#
# CPU dry run of the script itself (no GPU, no PyTorch needed):
#   BIN=target/debug/autotune DEVICE=cpu FINDERS= MODELS=tiny MAX_MB=8 \
#     EXTRA_TUNE_ARGS="--max-micro-batch 8" benches/gpu/issue3_bench.sh /tmp/i3
set -euo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [[ $# -ne 1 ]] || help_asked "$@"; then usage; fi

open_outdir "$1"

MODELS="${MODELS:-seed gpt-124m}"
DEVICE="${DEVICE:-rtx4090-32g}"
START="$(date +%s)"
say() { echo "issue3_bench.sh [$(( $(date +%s) - START ))s] $*" >&2; }

# settings MODEL: the per-model environment for tune_bench.sh, one NAME=VALUE per line.
settings() {
  local model="$1"
  local seconds=150 grid=60 steps=20 tune_timeout=60 offload_points="1,1024"
  if [[ "$model" == gpt-124m ]]; then
    seconds="${GPT_SECONDS:-330}"; grid=170; steps=15; tune_timeout=150
    # Near the plain boundary (48) and the checkpointed one (88).
    offload_points="${OFFLOAD_POINTS:-1,48 1,88}"
  else
    seconds="${SEED_SECONDS:-$seconds}"
    offload_points="${OFFLOAD_POINTS:-1,1024 1,1024}"
  fi
  echo "BENCH_SECONDS=$seconds"
  echo "GRID_SECONDS=$grid"
  echo "RUN_MODE=train"
  echo "RUN_STEPS=$steps"
  echo "TUNE_TIMEOUT=$tune_timeout"
  echo "RUN_TIMEOUT=90"
  echo "PROBE_TIMEOUT=40"
  echo "FINDER_TIMEOUT=100"
  echo "TUNE_ARGS=-v --record $OUTDIR/$model.profile.json${EXTRA_TUNE_ARGS:+ $EXTRA_TUNE_ARGS}"
  if [[ "$DEVICE" != cpu && -z "${REGIMES:-}" ]]; then
    local plain_off ckpt_off
    read -r plain_off ckpt_off <<< "$offload_points"
    echo "REGIMES=bf16:none:none bf16:all:none bf16:none:optimizer:$plain_off bf16:all:optimizer:$ckpt_off"
  fi
}

failed=()
for model in $MODELS; do
  env_args=()
  while IFS= read -r kv; do env_args+=("$kv"); done < <(settings "$model")
  say "$model: ${env_args[*]}"
  rc=0
  env "${env_args[@]}" DEVICE="$DEVICE" PYTHON="$PYTHON" \
    "$BENCH_DIR/tune_bench.sh" "$OUTDIR" "$model" || rc=$?
  (( rc == 0 )) || failed+=("$model (exit $rc)")
  say "$model: done (exit $rc)"
done

# ---- the combined summary ----------------------------------------------------------------
summary="$OUTDIR/issue3-summary.md"
{
  echo "# Issue 3 bench: autotune tune vs. finders, grid and training"
  echo
  echo "$(utc_now), commit ${COMMIT:-$(commit_id --short)}," \
       "GPU $(gpu_line none)," \
       "target $DEVICE, $(( $(date +%s) - START )) s in all."
  echo
  for model in $MODELS; do
    echo "## $model"
    echo
    file="$OUTDIR/$model.summary.md"
    if [[ -s "$file" ]]; then
      # The search-cost table with its notes, and the targets table.
      awk '/^## \(a\)/ { keep = 1; next } /^## / { keep = 0 } keep' "$file"
      awk '/^## Targets/ { keep = 1; next } /^## / { keep = 0 } keep' "$file"
    else
      echo "No summary (see $model.log)."
      echo
    fi
  done
  if (( ${#failed[@]} )); then
    echo "Stages that failed: ${failed[*]} (see the logs)."
  fi
} > "$summary"
say "summary in $summary"
(( ${#failed[@]} == 0 ))
