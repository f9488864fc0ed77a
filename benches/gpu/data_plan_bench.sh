#!/usr/bin/env bash
# data_plan_bench.sh — plans tuned on the data, and the longest sequence on the 24 GB box:
#
#   benches/gpu/data_plan_bench.sh OUTDIR [STAGE ...]
#
# Stages (default: data run):
#   data       benches/data/make_chat.py: the llama-3.2-1b-shaped folder and CONVERSATIONS chat
#              conversations of varied lengths → OUTDIR/work/ (not kept)
#   run        `autotune run --data chat.jsonl --target rtx4090-32g --epochs 1`: tuned on the
#              packed batches, then one full epoch (every example, the longest included) →
#              OUTDIR/run.{json,log,metrics.jsonl}, OUTDIR/run.plan.json
#   longest8b  `autotune tune --model llama-3.1-8b --target rtx4090-32g --allow-compact-state`:
#              the plan and the longest single sequence it takes, predicted and measured at the
#              edge → OUTDIR/8b.{plan.json,log}
#   torchtune  benches/gpu/torchtune_ref.py (its 8B single-device recipe) at batch 1, sequences
#              of TT_SEQS tokens in turn, one process each, on the same capped card, until one
#              does not fit → OUTDIR/torchtune-SEQ.json
#
# Needs the CUDA build in .gpu/ and, for torchtune, its wheels in $WHEELS (.whl; see
# benches/gpu/README.md). Environment: CONVERSATIONS (3000), TT_SEQS ("4096 6144 8192"),
# TUNE_TIMEOUT (300), PYTHON.
set -uo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -lt 1 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"
shift
STAGES="${*:-data run}"
CONVERSATIONS="${CONVERSATIONS:-3000}"
TT_SEQS="${TT_SEQS:-4096 6144 8192}"
TUNE_TIMEOUT="${TUNE_TIMEOUT:-300}"
WHEELS="${WHEELS:-.whl}"
BIN="$GPU_DIR/autotune"
WORK="$OUTDIR/work"
need_bin "build it with cuda-build.sh --out $GPU_DIR --bin autotune"
gpu_libraries "$GPU_DIR" wheels
record_header > "$OUTDIR/env.txt"
gpu_line >> "$OUTDIR/env.txt"

if wants data; then
  say "data: $CONVERSATIONS conversations"
  "${TORCH_ENV[@]}" "$PYTHON" benches/data/make_chat.py "$WORK" --conversations "$CONVERSATIONS" \
    > "$OUTDIR/data.json" 2>> "$OUTDIR/data.log"
  say "  $(cat "$OUTDIR/data.json")"
fi

if wants run; then
  say "run: tune on the data, then one epoch"
  rm -rf "$WORK/run"
  bounded 500 "$BIN" run --model "$WORK/model" --data "$WORK/chat.jsonl" \
    --target rtx4090-32g --epochs 1 --run-dir "$WORK/run" --cache-dir "$WORK/cache" \
    --checkpoint-every 1000000 --eval-every 0 --metrics "$OUTDIR/run.metrics.jsonl" --json \
    > "$OUTDIR/run.json" 2> "$OUTDIR/run.log"
  say "  exit $?"
  cp "$WORK/run/plan.json" "$OUTDIR/run.plan.json" 2> /dev/null
  grep -E '^\[|plan:|tuned on|lengths|longest|finished|error' "$OUTDIR/run.log" | tail -20 >&2
fi

if wants longest8b; then
  say "longest8b: llama-3.1-8b on rtx4090-32g with compact state"
  bounded "$TUNE_TIMEOUT" "$BIN" tune --model llama-3.1-8b --target rtx4090-32g \
    --allow-compact-state --out "$OUTDIR/8b.plan.json" > /dev/null 2> "$OUTDIR/8b.log"
  say "  exit $?"
  grep -E '^\[|plan:|longest' "$OUTDIR/8b.log" | tail -20 >&2
fi

if wants torchtune; then
  SITE=/tmp/tt_site
  rm -rf "$SITE"
  mapfile -t wheels < <(ls "$WHEELS"/{torchtune,torchao,omegaconf,antlr4,bitsandbytes}*.whl \
    2> /dev/null)
  "${TORCH_ENV[@]}" "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" \
    "${wheels[@]}" >> "$OUTDIR/pip.log" 2>&1 || say "pip: see pip.log"
  for seq in $TT_SEQS; do
    say "torchtune: llama-3.1-8b batch 1, $seq tokens"
    PYTHONPATH="$SITE" "${TORCH_ENV[@]}" "$PYTHON" benches/gpu/torchtune_ref.py --batch 1 \
      --seq "$seq" --warmup 1 --steps 2 --cap-mib 24564 --out "$OUTDIR/torchtune-$seq.json" \
      > /dev/null 2> "$OUTDIR/torchtune-$seq.log"
    say "  exit $?: $(head -c 300 "$OUTDIR/torchtune-$seq.json" 2> /dev/null)"
    grep -q '"oom": true' "$OUTDIR/torchtune-$seq.json" 2> /dev/null && break
  done
fi
say "done"
