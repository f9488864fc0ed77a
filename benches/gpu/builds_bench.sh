#!/usr/bin/env bash
# builds_bench.sh — builds of the engine against each other on the GPU of this machine, the card
# capped at 24 GB, in one call: a change is kept only where it measured faster than the build
# before it, in the same call, on the same card.
#
#   benches/gpu/builds_bench.sh OUTDIR BUILD...
#   benches/gpu/builds_bench.sh /tmp/r autotune-main autotune-trial
#
# BUILD: executables in $GPU_DIR (default .gpu); the first is the baseline the others are read
# against. Stages (STAGES, default "tests probes losses"):
#   tests   the CUDA tests named in TESTS (test-name filters, default: attention, the fused ops,
#           the norms, the loss, fp8, the compact update and a trial's empty pool) run by
#           TEST_BIN (default: the first it-* in $GPU_DIR, which should be built from the newest
#           code), one at a time → OUTDIR/tests.txt
#   probes  one tiny probe per build first (the driver compiles each build's PTX once; no timed
#           probe pays it), then ROUNDS rounds (default 2) of `autotune probe` for every row of
#           ROWS (default "gpt-1.3b:bf16:4 llama-3.2-1b:bf16:3 gpt-124m:bf16:16",
#           MODEL:PRECISION:MICRO_BATCH[:ACCUMULATION]), the builds alternating within each row
#           → OUTDIR/probes.jsonl, each line tagged with its build, row and round
#   losses  `autotune train` of each row of LOSS_ROWS (default "gpt-124m:bf16:16
#           gpt-1.3b:bf16:4") for LOSS_STEPS steps (default 20) on the built-in pattern data,
#           seed 7, by every build → OUTDIR/losses/BUILD-MODEL-PRECISION-bMB.jsonl: a change
#           that computes the same step must give the baseline's losses up to rounding
# then OUTDIR/summary.md (builds_report.py): the slower round of each build and row, and its
# ratio to the baseline's; each build's largest loss difference from the baseline's.
#
# Needs the CUDA builds in $GPU_DIR (cuda-build.sh --out .gpu, then renamed). Environment:
# STAGES, TESTS, TEST_BIN, ROWS, ROUNDS, WARMUP (default 3), STEPS (default 10), LOSS_ROWS,
# LOSS_STEPS, CAPACITY (default 24564MiB), PROBE_TIMEOUT (default 150 s), GPU_DIR, PYTHON.
set -uo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -lt 2 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"
shift
BUILDS=("$@")
STAGES="${STAGES:-tests probes losses}"
TESTS="${TESTS:-cuda_attention:: cuda_ops::cuda_fused_linear cuda_ops::cuda_norm_backward_plus cuda_ops::cuda_cross_entropy cuda_ops::cuda_layer_norm cuda_ops::cuda_decoder_ops cuda_ops::cuda_explicit cuda_ops::cuda_fp8 compact_state::the_cuda_ isolation::cuda_}"
ROWS="${ROWS:-gpt-1.3b:bf16:4 llama-3.2-1b:bf16:3 gpt-124m:bf16:16}"
ROUNDS="${ROUNDS:-2}"
WARMUP="${WARMUP:-3}"
STEPS="${STEPS:-10}"
CAPACITY="${CAPACITY:-24564MiB}"
PROBE_TIMEOUT="${PROBE_TIMEOUT:-150}"
LOSS_ROWS="${LOSS_ROWS-gpt-124m:bf16:16 gpt-1.3b:bf16:4}"
LOSS_STEPS="${LOSS_STEPS:-20}"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "$SCRIPT: ROUNDS must be a number from 1" >&2; exit 2; }
[[ "$LOSS_STEPS" =~ ^[1-9][0-9]*$ ]] || { echo "$SCRIPT: LOSS_STEPS must be a number from 1" >&2; exit 2; }
for build in "${BUILDS[@]}"; do
  BIN="$GPU_DIR/$build"
  need_bin "name builds in $GPU_DIR, e.g. cuda-build.sh --out $GPU_DIR, then rename autotune"
done
record_header > "$OUTDIR/env.txt"
gpu_line >> "$OUTDIR/env.txt"
echo "builds: ${BUILDS[*]} (baseline ${BUILDS[0]})" >> "$OUTDIR/env.txt"
gpu_libraries "$GPU_DIR" wheels

if wants tests; then
  TEST_BIN="${TEST_BIN:-$(ls "$GPU_DIR"/it-* 2>/dev/null | head -n 1)}"
  if [[ -x "$TEST_BIN" ]]; then
    say "tests: $TEST_BIN $TESTS"
    # shellcheck disable=SC2086  # TESTS is a list of filters
    bounded 300 "$TEST_BIN" $TESTS --nocapture --test-threads=1 \
      > "$OUTDIR/tests.txt" 2>&1
    echo "tests exit $?" >> "$OUTDIR/tests.txt"
    say "  $(grep -E '^test result' "$OUTDIR/tests.txt" | tail -n 1)"
  else
    say "tests: no it-* binary in $GPU_DIR (set TEST_BIN); skipped"
  fi
fi

# probe BUILD MODEL PRECISION MB ACCUM WARMUP STEPS: one probe's JSON line on stdout.
probe() {
  timeout --kill-after=10 "$PROBE_TIMEOUT" "$GPU_DIR/$1" probe --model "$2" --precision "$3" \
    --micro-batch "$4" --grad-accum "$5" --warmup "$6" --steps "$7" --device cuda \
    --gpu-capacity "$CAPACITY" --json 2>> "$OUTDIR/probes.log" | grep '^{'
}

if wants probes; then
  for build in "${BUILDS[@]}"; do
    say "compiling $build's kernels"
    probe "$build" seed bf16 1 1 1 1 > /dev/null
  done
  : > "$OUTDIR/probes.jsonl"
  for round in $(seq 1 "$ROUNDS"); do
    for row in $ROWS; do
      IFS=: read -r model precision mb accum <<< "$row"
      for build in "${BUILDS[@]}"; do
        say "round $round: $build $model $precision mb $mb accumulation ${accum:-1}"
        line="$(probe "$build" "$model" "$precision" "$mb" "${accum:-1}" "$WARMUP" "$STEPS")"
        say "  exit $?"
        [[ -n "$line" ]] && echo "{\"build\":\"$build\",\"row\":\"$row\",\"round\":$round,${line#\{}" \
          >> "$OUTDIR/probes.jsonl"
      done
    done
  done
fi

if wants losses; then
  mkdir -p "$OUTDIR/losses"
  for row in $LOSS_ROWS; do
    IFS=: read -r model precision mb _ <<< "$row"
    for build in "${BUILDS[@]}"; do
      out="$OUTDIR/losses/$build-$model-$precision-b$mb.jsonl"
      rm -f "$out"
      say "losses: $build $model $precision mb $mb, $LOSS_STEPS steps"
      bounded "$PROBE_TIMEOUT" "$GPU_DIR/$build" train --model "$model" \
        --precision "$precision" --micro-batch "$mb" --steps "$LOSS_STEPS" --seed 7 \
        --device cuda --data pattern -q --metrics "$out" 2>> "$OUTDIR/losses.log"
      say "  exit $?"
    done
  done
fi

"$PYTHON" "$BENCH_DIR/builds_report.py" "$OUTDIR" "${BUILDS[@]}" > "$OUTDIR/summary.md"
say "summary: $OUTDIR/summary.md"
cat "$OUTDIR/summary.md"
