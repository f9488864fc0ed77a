#!/usr/bin/env bash
# bigmodel_bench.sh — billion-parameter models on the emulated RTX 4090 (24564 MiB), without
# offload, against PyTorch eager in the same call:
#
#   benches/gpu/bigmodel_bench.sh OUTDIR [STAGE ...]
#
# Stages (default: all, in this order):
#   state    `autotune probe` of gpt-1.3b at micro-batches 1 and 2, after backward and in
#            backward: peak − activations per parameter (the law's fixed part, 2·peak(1) −
#            peak(2)), from the reported peak and from the pool's allocated high-water mark
#            (what PyTorch's max_memory_allocated counts) → OUTDIR/state.jsonl, state-*.log
#   tune     `autotune tune --model gpt-1.3b --target rtx4090-32g` (wall clock timed, -v, with
#            the recording) → OUTDIR/gpt-1.3b.{plan,profile}.json, tune.log, tune.time
#   train    20 steps with that plan (`autotune train --plan`) → OUTDIR/train.json
#   torch    PyTorch eager (fused AdamW, SDPA, autocast bf16, the same cap) on gpt-1.3b at
#            micro-batches 1, 2 and 4: its best feasible batch → OUTDIR/torch-1.3b.jsonl
# then OUTDIR/summary.md (bigmodel_report.py).
#
# Needs the CUDA build in .gpu/ (cuda-build.sh --out .gpu, plus a copy of gpu-env.sh).
# Environment: CAP_MIB (default 24564), TUNE_TIMEOUT (default 300 s), PYTHON.
set -uo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -lt 1 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"
shift
STAGES="${*:-state tune train torch}"
CAP_MIB="${CAP_MIB:-24564}"
TUNE_TIMEOUT="${TUNE_TIMEOUT:-300}"
BIN="$GPU_DIR/autotune"
MODEL=gpt-1.3b
need_bin "build it with cuda-build.sh --out $GPU_DIR"
gpu_libraries "$GPU_DIR" wheels
record_header > "$OUTDIR/env.txt"
gpu_line >> "$OUTDIR/env.txt"


if wants state; then
  say "state: gpt-1.3b probes at mb 1 and 2, both updates"
  : > "$OUTDIR/state.jsonl"
  for update in after-backward in-backward; do
    for mb in 1 2; do
      # The pool's high-water marks (allocated and reserved) and the bytes outside it go to
      # the log, one line per trial: the report reads the allocated mark from it.
      RUST_LOG=autotune::backend::pool=debug timeout --kill-after=10 240 "$BIN" probe \
        --model "$MODEL" --precision bf16 \
        --micro-batch "$mb" --update "$update" --warmup 1 --steps 3 --device cuda \
        --gpu-capacity "${CAP_MIB}MiB" --host-budget 32GiB --json \
        2> "$OUTDIR/state-$update-$mb.log" | grep '^{' | sed "s/^{/{\"update\": \"$update\", /" \
        >> "$OUTDIR/state.jsonl"
      say "  $update mb $mb: exit ${PIPESTATUS[0]}"
    done
  done
fi

if wants tune; then
  say "tune: $MODEL on rtx4090-32g"
  t0="$(date +%s.%N)"
  bounded "$TUNE_TIMEOUT" "$BIN" tune --model "$MODEL" --target rtx4090-32g -v \
    --record "$OUTDIR/$MODEL.profile.json" --out "$OUTDIR/$MODEL.plan.json" \
    > "$OUTDIR/tune.stdout" 2> "$OUTDIR/tune.log"
  rc=$?
  t1="$(date +%s.%N)"
  echo "{\"exit\": $rc, \"seconds\": $("$PYTHON" -c "print(round($t1 - $t0, 2))")}" > "$OUTDIR/tune.time"
  say "  tune: exit $rc, $(cat "$OUTDIR/tune.time")"
  grep -E '^\[|plan:|trials|  bf16' "$OUTDIR/tune.log" | tail -40 >&2
fi

if wants train && [[ -f "$OUTDIR/$MODEL.plan.json" ]]; then
  say "train: 20 steps with the plan"
  bounded 300 "$BIN" train --plan "$OUTDIR/$MODEL.plan.json" --steps 20 \
    --data pattern --json > "$OUTDIR/train.json" 2> "$OUTDIR/train.log"
  say "  train: exit $?: $(head -c 400 "$OUTDIR/train.json")"
fi

if wants torch; then
  say "torch: $MODEL eager at 1, 2, 4 under the same cap"
  "${TORCH_ENV[@]}" "$PYTHON" benches/gpu/torch_ref.py --model "$MODEL" --precision bf16 \
    --micro-batch 1,2,4 --warmup 2 --steps 6 --cap-mib "$((CAP_MIB - 512))" \
    > "$OUTDIR/torch-1.3b.jsonl" 2> "$OUTDIR/torch-1.3b.log"
  say "  torch: exit $?"
  cat "$OUTDIR/torch-1.3b.log" >&2
fi

"$PYTHON" benches/gpu/bigmodel_report.py "$OUTDIR" > "$OUTDIR/summary.md" 2>> "$OUTDIR/report.log"
cat "$OUTDIR/summary.md"
say "done"
