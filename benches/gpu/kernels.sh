#!/usr/bin/env bash
# kernels.sh — where a training step's GPU time goes: every kernel of a short `autotune train`
# run timed by Nsight Compute (one metric, gpu__time_duration, clocks left alone), then summed
# per kernel name and per kind (matrix products, copies, elementwise, reductions, ours).
#
#   benches/gpu/kernels.sh OUTDIR MODEL PRECISION MICRO_BATCH [STEPS [torch]]
#
# With `torch` last, the PyTorch eager reference runs instead, for comparison: torch_ref.py, or
# for the decoder presets (llama-*, qwen*, smollm2-*) transformers' own model (llama_ref.py).
# Writes OUTDIR/kernels-MODEL-PRECISION-bMICRO.csv (ncu's raw rows) and .md (the summary,
# per optimizer step: the total divided by STEPS, default 2).
# Environment: GPU_DIR (default .gpu), NCU (default: ncu on PATH, else Nsight Compute's folder).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -lt 4 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"
MODEL="$2"; PRECISION="$3"; MB="$4"; STEPS="${5:-2}"
NCU="$(find_ncu)"
[[ -x "$NCU" ]] || { echo "kernels.sh: ncu not found" >&2; exit 2; }
if [[ "${6:-}" == torch ]]; then
  NAME="kernels-torch-$MODEL-$PRECISION-b$MB"
  case "$MODEL" in
    llama-*|qwen*|smollm2-*)
      CMD=(python3 benches/gpu/llama_ref.py --model "$MODEL" --micro-batch "$MB" --warmup 0 --steps "$STEPS") ;;
    *)
      CMD=(python3 benches/gpu/torch_ref.py --model "$MODEL" --precision "$PRECISION" --micro-batch "$MB" --warmup 0 --steps "$STEPS") ;;
  esac
else
  NAME="kernels-$MODEL-$PRECISION-b$MB"
  CMD=("$GPU_DIR/autotune" train --model "$MODEL" --precision "$PRECISION" --micro-batch "$MB" --steps "$STEPS" --device cuda --data random -q)
fi
"$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --page raw --print-units base \
  "${CMD[@]}" > "$OUTDIR/$NAME.csv" 2> "$OUTDIR/$NAME.log" || true
python3 "$ROOT/benches/gpu/kernels.py" "$OUTDIR/$NAME.csv" "$STEPS" > "$OUTDIR/$NAME.md"
cat "$OUTDIR/$NAME.md"
