#!/usr/bin/env bash
# fp8_bench.sh — fp8 products against bf16 on the GPU of this machine, the card capped at
# 24 GB, in one call:
#
#   benches/gpu/fp8_bench.sh OUTDIR [STAGE ...]
#
# Stages (default: all, in this order):
#   speed   `autotune probe` of gpt-1.3b at mb $MB (default 4, the bf16 plan's) in bf16 and in
#           fp8, alternating, $ROUNDS rounds (default 2) → OUTDIR/speed.jsonl
#   loss    `autotune train` of gpt-124m for $STEPS steps (default 500) on $CORPUS (text, read
#           as bytes), mb 16, in bf16 and in fp8 with seed 7, then bf16 with seed 8 (the
#           run-to-run spread) → OUTDIR/loss-{bf16,fp8,bf16-seed8}.jsonl
# then OUTDIR/summary.md and OUTDIR/headline.json (fp8_report.py).
#
# Needs the CUDA build in .gpu/ and a GPU with fp8 tensor cores (compute capability 8.9+).
# Environment: MB, ROUNDS, STEPS, CORPUS (default .gpu/tinyshakespeare.txt), CAPACITY
# (default 24564MiB), PYTHON.
set -uo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -lt 1 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"
shift
STAGES="${*:-speed loss}"
MB="${MB:-4}"
ROUNDS="${ROUNDS:-2}"
STEPS="${STEPS:-500}"
CORPUS="${CORPUS:-.gpu/tinyshakespeare.txt}"
CAPACITY="${CAPACITY:-24564MiB}"
BIN="$GPU_DIR/autotune"
need_bin "build it with cuda-build.sh --out $GPU_DIR"
record_header > "$OUTDIR/env.txt"
gpu_line >> "$OUTDIR/env.txt"
gpu_libraries "$GPU_DIR" wheels

if wants speed; then
  : > "$OUTDIR/speed.jsonl"
  for round in $(seq 1 "$ROUNDS"); do
    for precision in bf16 fp8; do
      say "speed: gpt-1.3b mb $MB $precision round $round"
      timeout --kill-after=10 240 "$BIN" probe --model gpt-1.3b --precision "$precision" \
        --micro-batch "$MB" --warmup 2 --steps 8 --device cuda --gpu-capacity "$CAPACITY" \
        --json 2>> "$OUTDIR/speed.log" | grep '^{' >> "$OUTDIR/speed.jsonl"
      say "  exit ${PIPESTATUS[0]}"
    done
  done
fi

if wants loss; then
  # bf16 also with a second seed: the spread between two bf16 runs is what fp8's difference
  # from bf16 is read against.
  for run in bf16:7 fp8:7 bf16:8; do
    precision="${run%:*}"; seed="${run#*:}"
    name="$precision"; [[ "$seed" != 7 ]] && name="$precision-seed$seed"
    say "loss: gpt-124m $STEPS steps $precision seed $seed on $CORPUS"
    bounded 300 "$BIN" train --model gpt-124m --precision "$precision" \
      --micro-batch 16 --steps "$STEPS" --seed "$seed" --device cuda \
      --data "$CORPUS" --tokenizer bytes --metrics "$OUTDIR/loss-$name.jsonl" -q \
      2> "$OUTDIR/loss-$name.log"
    say "  exit $?"
  done
fi

"$PYTHON" benches/gpu/fp8_report.py "$OUTDIR" > "$OUTDIR/summary.md" || say "summary failed"
say "done: $OUTDIR/summary.md"
