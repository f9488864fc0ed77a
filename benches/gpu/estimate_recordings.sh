#!/usr/bin/env bash
# estimate_recordings.sh — record searches with the current engine, and hold the analytic memory
# estimate (`autotune estimate`) to every trial they measured.
#
#   benches/gpu/estimate_recordings.sh OUTDIR [MODEL...]
#   benches/gpu/estimate_recordings.sh benches/results/$(date +%Y-%m-%d)-h200-estimate seed gpt-124m gpt-350m
#
# For each model (default: seed gpt-124m gpt-350m), each command under `timeout`:
#   tune      `autotune tune --model MODEL --target $DEVICE --record OUTDIR/MODEL.json
#             --out OUTDIR/MODEL.plan.json` (the default search space: bf16 with and without
#             checkpointing and offload, the update in backward where it applies)
#   estimate  `autotune estimate --profile OUTDIR/MODEL.json`: OUTDIR/MODEL.estimate.json (every
#             fitted trial, measured and estimated bytes, relative errors) and .estimate.txt
#   report    `autotune report OUTDIR/MODEL.json --out OUTDIR/MODEL.html`
# then summary.txt: each model's worst and mean relative error. env.txt records the machine.
#
# Making them committed recordings: copy OUTDIR/MODEL.json over
# profiles/recorded/rtx4090-32g-on-h200/MODEL.json (the seed and gpt-124m recordings there predate
# the chunked head), list them under CURRENT in tests/it/estimate.rs, and update the README's
# table under "Memory estimate".
#
# Environment (all optional):
#   BIN            autotune binary (default .gpu/autotune; target/debug/autotune with DEVICE=cpu
#                  for a dry run on a CPU)
#   DEVICE         target profile (default rtx4090-32g)
#   TUNE_ARGS      extra arguments for tune
#   TUNE_TIMEOUT   seconds per search (default 600)
#   GPU_ENV        gpu-env.sh to source (default: next to BIN, then ../shared/tools/gpu-env.sh)
set -euo pipefail
export LC_NUMERIC=C
export NO_COLOR=1
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if help_asked "$@" || [[ $# -lt 1 ]]; then usage; fi
open_outdir "$1"
shift
MODELS=("$@")
if [[ ${#MODELS[@]} -eq 0 ]]; then MODELS=(seed gpt-124m gpt-350m); fi
BIN="${BIN:-$GPU_DIR/autotune}"
DEVICE="${DEVICE:-rtx4090-32g}"
TUNE_TIMEOUT="${TUNE_TIMEOUT:-600}"
read -r -a EXTRA <<< "${TUNE_ARGS:-}"
need_bin "build it with ../shared/tools/cuda-build.sh --out .gpu"
if [[ "$DEVICE" != cpu ]]; then gpu_libraries "$(dirname "$BIN")" wheels; fi

{
  record_header
  echo "gpu: $(gpu_line none)"
  echo "binary: $("$BIN" --version 2>/dev/null || echo unknown)"
  echo "device: $DEVICE"
  echo "models: ${MODELS[*]}"
} > "$OUTDIR/env.txt"

LOG="$OUTDIR/log.txt"
: > "$LOG"
if [[ "$DEVICE" != cpu ]]; then
  warm_up 120 "$LOG" cuda bf16 || echo "$SCRIPT: the warm-up probe failed (see $LOG)" >&2
fi

SUMMARY="$OUTDIR/summary.txt"
: > "$SUMMARY"
for model in "${MODELS[@]}"; do
  profile="$OUTDIR/$model.json"
  echo "$SCRIPT: tuning $model on $DEVICE" >&2
  rc=0
  bounded "$TUNE_TIMEOUT" "$BIN" tune --model "$model" --target "$DEVICE" \
    --record "$profile" --out "$OUTDIR/$model.plan.json" "${EXTRA[@]}" \
    > "$OUTDIR/$model.tune.txt" 2>> "$LOG" || rc=$?
  # tune exits 1 when nothing is feasible: its recording still holds every trial.
  if [[ ! -f "$profile" ]]; then
    echo "$model: tune exited $rc without a recording (see $LOG)" >> "$SUMMARY"
    continue
  fi
  "$BIN" estimate --profile "$profile" --json > "$OUTDIR/$model.estimate.json" 2>> "$LOG"
  "$BIN" estimate --profile "$profile" > "$OUTDIR/$model.estimate.txt" 2>> "$LOG"
  "$BIN" report "$profile" --out "$OUTDIR/$model.html" 2>> "$LOG"
  echo "$model (tune exit $rc): $(tail -n 1 "$OUTDIR/$model.estimate.txt")" >> "$SUMMARY"
done
cat "$SUMMARY"
