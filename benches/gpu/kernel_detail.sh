#!/usr/bin/env bash
# kernel_detail.sh — why one of our kernels is slow: Nsight Compute's full set of sections
# (occupancy, registers and shared memory per block, compute and memory throughput, the warps'
# stall reasons, the source counters) for a few launches of the kernels whose names match a
# pattern, taken from a short `autotune train` after its first step:
#
#   benches/gpu/kernel_detail.sh OUTDIR MODEL PRECISION MICRO_BATCH REGEX
#   benches/gpu/kernel_detail.sh /tmp/kd gpt-124m bf16 16 'flash_(fwd|bwd)'
#
# Writes OUTDIR/detail-MODEL-bMB.ncu-rep (open it in Nsight Compute), .txt (the details page as
# text) and .csv (the same as CSV), and .log (ncu's and the run's stderr).
# `breakdown.sh` says which kernels take the time; this says why.
#
# Environment: SKIP (matching launches skipped first, default 12: one step of a 12-block model's
# per-block kernels, so that the first step's setup is not what is measured), COUNT (launches
# profiled, default 3), STEPS (the run's steps, default 3), NCU, GPU_DIR, NCU_TIMEOUT (default
# 480 s). Needs the CUDA build in .gpu/ and Nsight Compute; a full-set launch costs seconds.
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -ne 5 ]] || help_asked "$@"; then usage; fi
MODEL="$2"; PRECISION="$3"; MB="$4"; REGEX="$5"
[[ "$PRECISION" =~ ^(fp32|bf16|fp16|fp8)$ ]] || { echo "$SCRIPT: precision must be fp32, bf16, fp16 or fp8" >&2; exit 2; }
[[ "$MB" =~ ^[1-9][0-9]*$ ]] || { echo "$SCRIPT: MICRO_BATCH must be a number from 1" >&2; exit 2; }
SKIP="${SKIP:-12}"; COUNT="${COUNT:-3}"; STEPS="${STEPS:-3}"
for n in SKIP COUNT STEPS; do
  [[ "${!n}" =~ ^[0-9]+$ ]] || { echo "$SCRIPT: $n must be a whole number" >&2; exit 2; }
done
NCU_TIMEOUT="${NCU_TIMEOUT:-480}"
open_outdir "$1"
BIN="$GPU_DIR/autotune"
need_bin "build it with cuda-build.sh --out $GPU_DIR"
NCU="$(find_ncu)"
[[ -x "$NCU" ]] || { echo "$SCRIPT: Nsight Compute's ncu not found (set NCU)" >&2; exit 2; }
gpu_libraries "$GPU_DIR" wheels

OUT="$OUTDIR/detail-$MODEL-b$MB"
{
  echo "== $SCRIPT $*"
  record_header
  gpu_line "no nvidia-smi"
  echo "ncu: $NCU $("$NCU" --version 2>/dev/null | tail -n 1)"
  echo "kernels matching: $REGEX; skipped $SKIP, profiled $COUNT"
} >> "$OUTDIR/env.txt"

say "ncu --set full on '$REGEX' ($COUNT launches after $SKIP)"
bounded "$NCU_TIMEOUT" "$NCU" --set full --import-source yes \
  --clock-control none --kernel-name "regex:$REGEX" --launch-skip "$SKIP" \
  --launch-count "$COUNT" -f -o "$OUT" \
  "$BIN" train --model "$MODEL" --precision "$PRECISION" --micro-batch "$MB" \
  --steps "$STEPS" --device cuda --data random -q > /dev/null 2> "$OUT.log"
rc=$?
say "  exit $rc"
if [[ -s "$OUT.ncu-rep" ]]; then
  "$NCU" --import "$OUT.ncu-rep" --page details > "$OUT.txt" 2>> "$OUT.log"
  "$NCU" --import "$OUT.ncu-rep" --page details --csv > "$OUT.csv" 2>> "$OUT.log"
  say "done: $OUT.txt"
else
  say "no report: no launch matched, or the run failed (see $OUT.log)"
  exit 1
fi
