#!/usr/bin/env bash
# breakdown.sh — where one training step's time goes on the GPU: kernel time per class (GEMM,
# attention, norms and elementwise, loss head, optimizer, copies and casts, other) against the
# wall-clock step measured without the profiler, the rest of the step being idle gaps; tokens/s
# and MFU (6·N FLOPs per token over 989 TFLOP/s); the step's GEMMs against cuBLAS alone at the
# same shapes. Ours, and with `torch` the PyTorch reference beside it:
#
#   benches/gpu/breakdown.sh OUTDIR MODEL PRECISION MICRO_BATCH [STEPS] [torch]
#   benches/gpu/breakdown.sh benches/results/$(date +%Y-%m-%d)-h100-breakdown gpt-1.3b bf16 4 torch
#
# Stages (STAGES, default "ours gemm", and "torch" too with `torch`):
#   ours    the wall step without the profiler: `autotune probe` (3 warm-up and 10 timed steps:
#           N, tokens per step, its median) and `autotune train --steps 14 --metrics` (the
#           command that is profiled; the median of its steps 5-14 is the wall step); then that
#           `train` under Nsight Compute twice, for NCU_WARM (default 2) and NCU_WARM + STEPS
#           (default 2) steps
#   torch   the same for torch_ref.py (gpt-*, seed) or llama_ref.py (llama-*, qwen*, smollm2-*;
#           bf16 only): its own JSON line (3 warm-up and 10 timed steps) gives the wall step,
#           then two profiled runs
#   gemm    gemm_shapes.py: every matrix product of the step timed alone with cuBLAS (bf16)
# then always the report, from whatever OUTDIR holds (so a later call can add a side):
# OUTDIR/breakdown-MODEL-bMB.md and .json (the sides next to each other), and
# breakdown-MODEL-bMB-SIDE.md and .json for each side (breakdown.py).
#
# Kernel time per step is (longer profiled run - shorter one) / STEPS, kernel by kernel: weight
# initialisation, the check of the weights, the first steps' setup and the end of the run drop
# out. ncu leaves clocks and caches alone (--clock-control none --cache-control none), so each
# kernel runs as in the unprofiled run, though one at a time.
#
# Each stage runs under `timeout` and records its exit status and seconds in OUTDIR/stages.txt;
# one that fails leaves the others running. Needs the CUDA build in .gpu/ (cuda-build.sh --out
# .gpu), Nsight Compute (ncu) and PyTorch (with transformers for the decoders). Expected on an
# H100 (ncu costs 10-15 ms per kernel launch; a step launches about 1,000 of ours and
# 2,000-3,000 of PyTorch's): ours and gemm 3-4 minutes for gpt-1.3b bf16 mb 4 or llama-3.2-1b
# bf16 mb 3, the PyTorch side 4-6 more. Where one call may take 10 minutes at most, run the
# default stages first and then STAGES=torch into the same OUTDIR.
# Environment: STAGES, TORCH_COMPILE (1: the GPT reference under torch.compile, still named
# "pytorch" in the files; its profiled runs leave compilation outside the profiler), NCU (default: ncu on PATH, else Nsight Compute's folder), NCU_WARM,
# NCU_TIMEOUT (default 480 s a profiled run), RUN_TIMEOUT (default 300 s an unprofiled one),
# GPU_DIR, PYTHON.
set -uo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -lt 4 ]] || help_asked "$@"; then usage; fi
MODEL="$2"; PRECISION="$3"; MB="$4"
STEPS=2; WITH_TORCH=0
for arg in "${@:5}"; do
  if [[ "$arg" == torch ]]; then
    WITH_TORCH=1
  elif [[ "$arg" =~ ^[1-9][0-9]*$ ]]; then
    STEPS="$arg"
  else
    echo "$SCRIPT: '$arg' is neither STEPS (a number from 1) nor torch" >&2
    exit 2
  fi
done
[[ "$PRECISION" =~ ^(fp32|bf16|fp16|fp8)$ ]] || { echo "$SCRIPT: precision must be fp32, bf16, fp16 or fp8" >&2; exit 2; }
[[ "$MB" =~ ^[1-9][0-9]*$ ]] || { echo "$SCRIPT: MICRO_BATCH must be a number from 1" >&2; exit 2; }
DEFAULT_STAGES="ours gemm"
(( WITH_TORCH )) && DEFAULT_STAGES="ours torch gemm"
STAGES="${STAGES:-$DEFAULT_STAGES}"
NCU_WARM="${NCU_WARM:-2}"
[[ "$NCU_WARM" =~ ^[1-9][0-9]*$ ]] || { echo "$SCRIPT: NCU_WARM must be a number from 1" >&2; exit 2; }
NCU_TIMEOUT="${NCU_TIMEOUT:-480}"
RUN_TIMEOUT="${RUN_TIMEOUT:-300}"
open_outdir "$1"

BIN="$GPU_DIR/autotune"
NCU="$(find_ncu)"
NCU_ARGS=(--clock-control none --cache-control none --metrics gpu__time_duration.sum --csv
  --page raw --print-units base)
TAG="$MODEL-$PRECISION-b$MB"        # the stages' own files
NAME="breakdown-$MODEL-b$MB"        # the report
GEMM="$OUTDIR/gemm-$MODEL-b$MB"
SHORT="$NCU_WARM"
LONG="$(( NCU_WARM + STEPS ))"

# stage LABEL SECONDS OUT LOG CMD...: CMD under `bounded` (lib.sh), its stdout into OUT and its stderr
# appended to LOG; its exit status and seconds go to OUTDIR/stages.txt. Always returns 0, so
# that a stage that fails or runs out of time leaves the next one running.
stage() {
  local label="$1" seconds="$2" out="$3" log="$4" t0 rc=0
  shift 4
  t0="$(date +%s)"
  echo "== $(utc_now) $label: $*" >> "$log"
  say "$label"
  bounded "$seconds" "$@" > "$out" 2>> "$log" || rc=$?
  echo "$(utc_now) $label: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$OUTDIR/stages.txt" >&2
  return 0
}

# skip LABEL WHY: a stage that cannot run, recorded as such.
skip() { echo "$(utc_now) $1: skipped, $2" | tee -a "$OUTDIR/stages.txt" >&2; }

# has_kernels CSV: whether an ncu CSV holds kernel rows (a failed run leaves only its errors).
has_kernels() { [[ -s "$1" ]] && grep -q '^"[0-9]' "$1"; }

# ---- setup --------------------------------------------------------------------------------------
# PyTorch runs under TORCH_ENV (lib.sh), with the library path this script started with.
[[ -d "$GPU_DIR" ]] && gpu_libraries "$GPU_DIR" wheels
{
  echo "== $SCRIPT $*"
  record_header
  gpu_line "no nvidia-smi"
  echo "stages: $STAGES; profiled runs: $SHORT and $LONG steps"
  echo "ncu: ${NCU:-none} $("$NCU" --version 2>/dev/null | tail -n 1)"
  "${TORCH_ENV[@]}" "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -n 1
} >> "$OUTDIR/env.txt"
[[ -x "$NCU" ]] || say "no ncu found (set NCU): the profiled runs are skipped"

# ---- ours ---------------------------------------------------------------------------------------
KNOBS=(--model "$MODEL" --precision "$PRECISION" --micro-batch "$MB")
TRAIN=("$BIN" train "${KNOBS[@]}" --device cuda --data random -q)

ours_wall() {
  local log="$OUTDIR/$TAG-ours.log"
  # The first load compiles the binary's PTX (12-16 s); a tiny probe takes that out of the timing.
  warm_up "$RUN_TIMEOUT" "$log" cuda "$PRECISION" || say "warm-up probe failed (see $log)"
  stage "ours: probe" "$RUN_TIMEOUT" "$OUTDIR/$TAG-ours.probe.json" "$log" \
    "$BIN" probe "${KNOBS[@]}" --warmup 3 --steps 10 --device cuda --json
  rm -f "$OUTDIR/$TAG-ours.metrics.jsonl"
  stage "ours: train, 14 steps" "$RUN_TIMEOUT" "$OUTDIR/$TAG-ours.train.txt" "$log" \
    "${TRAIN[@]}" --steps 14 --metrics "$OUTDIR/$TAG-ours.metrics.jsonl"
}

ours_profiled() {
  local steps
  for steps in "$SHORT" "$LONG"; do
    stage "ours: ncu, $steps steps" "$NCU_TIMEOUT" "$OUTDIR/$TAG-ours.ncu-$steps.csv" \
      "$OUTDIR/$TAG-ours.ncu-$steps.log" "$NCU" "${NCU_ARGS[@]}" "${TRAIN[@]}" --steps "$steps"
  done
}

# ---- PyTorch ------------------------------------------------------------------------------------
case "$MODEL" in
  llama-*|qwen*|smollm2-*)
    REF=(benches/gpu/llama_ref.py --model "$MODEL" --micro-batch "$MB")
    [[ "$PRECISION" == bf16 ]] || REF=() ;;
  *)
    REF=(benches/gpu/torch_ref.py --model "$MODEL" --precision "$PRECISION" --micro-batch "$MB")
    # The side is then torch.compile's. Under the profiler its compilation would launch
    # thousands of kernels, each profiled (about 90 s a step): the profiled runs compile in
    # three unprofiled warm-up steps and profile only the steps after them.
    [[ "${TORCH_COMPILE:-}" == 1 ]] && REF+=(--compile) && TORCH_PROFILED_AFTER=3 ;;
esac

torch_wall() {
  stage "torch: wall" "$RUN_TIMEOUT" "$OUTDIR/$TAG-pytorch.run.json" "$OUTDIR/$TAG-pytorch.log" \
    "${TORCH_ENV[@]}" "$PYTHON" "${REF[@]}" --warmup 3 --steps 10
}

torch_profiled() {
  local steps warm=(--warmup 0) ncu_args=("${NCU_ARGS[@]}")
  if [[ -n "${TORCH_PROFILED_AFTER:-}" ]]; then
    warm=(--warmup "$TORCH_PROFILED_AFTER" --profiler-range)
    ncu_args+=(--profile-from-start off)
  fi
  for steps in "$SHORT" "$LONG"; do
    stage "torch: ncu, $steps steps" "$NCU_TIMEOUT" "$OUTDIR/$TAG-pytorch.ncu-$steps.csv" \
      "$OUTDIR/$TAG-pytorch.ncu-$steps.log" \
      "${TORCH_ENV[@]}" "$NCU" "${ncu_args[@]}" "$PYTHON" "${REF[@]}" "${warm[@]}" --steps "$steps"
  done
}

# ---- GEMMs alone --------------------------------------------------------------------------------
gemm() {
  stage "gemm: cuBLAS at the step's shapes" "$RUN_TIMEOUT" "$GEMM.md" "$GEMM.log" \
    "${TORCH_ENV[@]}" "$PYTHON" benches/gpu/gemm_shapes.py --model "$MODEL" --micro-batch "$MB" \
    --json "$GEMM.json"
}

# ---- the report ---------------------------------------------------------------------------------
# report_side SIDE RUN_JSON LAYOUT [BREAKDOWN_ARG...]: OUTDIR/NAME-SIDE.{md,json} from the side's
# files, with what there is of them; a side without a profiled run or a wall step is left out.
report_side() {
  local side="$1" run_json="$2" layout="$3" csv steps args=()
  shift 3
  for steps in "$SHORT" "$LONG"; do
    csv="$OUTDIR/$TAG-$side.ncu-$steps.csv"
    has_kernels "$csv" && args+=(--ncu "$csv" "$steps")
  done
  rm -f "$OUTDIR/$NAME-$side.json"
  if ! compgen -G "$OUTDIR/$TAG-$side.*" > /dev/null; then
    return 0  # this side was never asked for
  elif [[ ! -s "$run_json" ]]; then
    say "report: no $side side: $(basename "$run_json") is missing or empty (see the log)"
    return 0
  elif [[ ${#args[@]} -eq 0 ]]; then
    say "report: no $side side: no profiled run with kernels (see the .ncu-*.log files)"
    return 0
  fi
  [[ -s "$GEMM.json" ]] && args+=(--gemm-shapes "$GEMM.json" --gemm-layout "$layout")
  "$PYTHON" benches/gpu/breakdown.py side --name "$side" --run-json "$run_json" "${args[@]}" "$@" \
    --json "$OUTDIR/$NAME-$side.json" > "$OUTDIR/$NAME-$side.md" 2>> "$OUTDIR/report.log" \
    || { say "report: the $side side failed (see report.log)"; rm -f "$OUTDIR/$NAME-$side.json"; }
}

report() {
  local metrics="$OUTDIR/$TAG-ours.metrics.jsonl" wall=() sides=() side
  # The wall step of ours is the profiled command's own, when its metrics came.
  [[ -s "$metrics" ]] && wall=(--metrics "$metrics" --skip 4)
  report_side ours "$OUTDIR/$TAG-ours.probe.json" fused "${wall[@]}"
  # transformers' Llama runs q, k, v and gate, up as products of their own; GPT is the same
  # in both layouts.
  report_side pytorch "$OUTDIR/$TAG-pytorch.run.json" separate
  for side in ours pytorch; do
    [[ -s "$OUTDIR/$NAME-$side.json" ]] && sides+=("$OUTDIR/$NAME-$side.json")
  done
  if [[ ${#sides[@]} -eq 0 ]]; then
    say "report: nothing to report (see stages.txt and the logs)"
    return 1
  fi
  "$PYTHON" benches/gpu/breakdown.py join "${sides[@]}" --json "$OUTDIR/$NAME.json" \
    > "$OUTDIR/$NAME.md" 2>> "$OUTDIR/report.log"
  cat "$OUTDIR/$NAME.md"
}

# ---- the run ------------------------------------------------------------------------------------
# The unprofiled runs first and next to each other, so that both sides see the same clocks.
if wants ours; then
  if [[ -x "$BIN" ]]; then ours_wall; else skip "ours" "no $BIN (cuda-build.sh --out $GPU_DIR)"; fi
fi
if wants torch; then
  if [[ ${#REF[@]} -gt 0 ]]; then torch_wall; else skip "torch" "the $MODEL reference runs bf16 only"; fi
fi
if wants gemm; then
  if [[ "$PRECISION" != bf16 ]]; then
    skip "gemm" "cuBLAS is timed in bf16, this run is $PRECISION"
  elif ! "$PYTHON" benches/gpu/gemm_shapes.py --model "$MODEL" --micro-batch "$MB" --dry-run > /dev/null 2>&1; then
    skip "gemm" "gemm_shapes.py has no preset $MODEL"
  else
    gemm
  fi
fi
if wants ours && [[ -x "$BIN" && -x "$NCU" ]]; then ours_profiled; fi
if wants torch && [[ ${#REF[@]} -gt 0 && -x "$NCU" ]]; then torch_profiled; fi
report
rc=$?
say "done"
exit "$rc"
