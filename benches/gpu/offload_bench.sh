#!/usr/bin/env bash
# offload_bench.sh — optimizer offload on the emulated RTX 4090 (24564 MiB) with a 32 GB host,
# against DeepSpeed ZeRO-2 + CPU offload in the same call:
#
#   benches/gpu/offload_bench.sh OUTDIR [STAGE ...]
#
# Stages (default: all, in this order):
#   ours       `autotune probe --offload optimizer` of gpt-1.3b at micro-batch 4 (no
#              checkpointing, as DeepSpeed runs it) and 8 → OUTDIR/ours.jsonl, ours.log (run
#              with RUST_LOG=autotune::offload=debug for the host update's times); the same
#              micro-batches on the device alone, uncapped → OUTDIR/ours-device.jsonl
#   deepspeed  DeepSpeed 0.19.8 (installed from the wheels in WHEELS, default .whl) on the same
#              model and micro-batches → OUTDIR/deepspeed.jsonl, deepspeed.log
#   big        `autotune tune --model gpt-2b --target rtx4090-32g` (wall clock timed) and 20
#              training steps with its plan → OUTDIR/gpt-2b.{plan,profile}.json, tune-2b.*,
#              train-2b.json
# then OUTDIR/summary.md (offload_report.py).
#
# Needs the CUDA build in .gpu/. Environment: CAP_MIB (default 24564), MICRO_BATCHES (default
# "4 8"), WHEELS, PYTHON.
# The host link is the GPU machine's, not a 4090's PCIe 4 (about 25 GB/s): say which.
set -uo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -lt 1 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"
shift
STAGES="${*:-ours deepspeed big}"
CAP_MIB="${CAP_MIB:-24564}"
MICRO_BATCHES="${MICRO_BATCHES:-4 8}"
WHEELS="${WHEELS:-.whl}"
BIN="$GPU_DIR/autotune"
need_bin "build it with cuda-build.sh --out $GPU_DIR"
gpu_libraries "$GPU_DIR" wheels
record_header > "$OUTDIR/env.txt"
gpu_line >> "$OUTDIR/env.txt"
nproc >> "$OUTDIR/env.txt"

if wants ours; then
  warm_up 120 "$OUTDIR/ours.log" cuda bf16
  : > "$OUTDIR/ours.jsonl"
  for mb in $MICRO_BATCHES; do
    say "ours: gpt-1.3b offload mb $mb"
    timeout --kill-after=10 240 "$BIN" probe \
      --model gpt-1.3b --precision bf16 --micro-batch "$mb" --offload optimizer \
      --warmup 2 --steps 4 --device cuda --gpu-capacity "${CAP_MIB}MiB" --host-budget 30GiB \
      --json 2>> "$OUTDIR/ours.log" | grep '^{' >> "$OUTDIR/ours.jsonl"
    say "  exit ${PIPESTATUS[0]}: $(tail -n 1 "$OUTDIR/ours.jsonl" | head -c 300)"
  done
  # The device's part of the floor: the same step without offload and without the cap (the
  # state then fits the whole GPU), so its time is the passes' alone.
  : > "$OUTDIR/ours-device.jsonl"
  for mb in $MICRO_BATCHES; do
    say "ours: gpt-1.3b on-device mb $mb, uncapped (the floor's device time)"
    timeout --kill-after=10 240 "$BIN" probe \
      --model gpt-1.3b --precision bf16 --micro-batch "$mb" \
      --warmup 2 --steps 4 --device cuda --json 2>> "$OUTDIR/ours.log" \
      | grep '^{' >> "$OUTDIR/ours-device.jsonl"
  done
fi

if wants deepspeed; then
  say "deepspeed: install from $WHEELS"
  site=/tmp/ds-site
  "${TORCH_ENV[@]}" "$PYTHON" -m pip install -q --no-index --no-deps --target "$site" \
    "$WHEELS"/*.whl > "$OUTDIR/deepspeed-install.log" 2>&1
  DS_BUILD_OPS=0 "${TORCH_ENV[@]}" "$PYTHON" -m pip install -q --no-index --no-deps \
    --no-build-isolation --target "$site" "$WHEELS"/deepspeed-*.tar.gz \
    >> "$OUTDIR/deepspeed-install.log" 2>&1
  say "  installed: exit $?"
  : > "$OUTDIR/deepspeed.jsonl"
  for mb in $MICRO_BATCHES; do
    say "deepspeed: gpt-1.3b mb $mb"
    PYTHONPATH="$site" bounded 300 "${TORCH_ENV[@]}" "$PYTHON" \
      benches/gpu/deepspeed_ref.py --model gpt-1.3b --micro-batch "$mb" --warmup 2 --steps 4 \
      --cap-mib "$((CAP_MIB - 512))" >> "$OUTDIR/deepspeed.jsonl" 2>> "$OUTDIR/deepspeed.log"
    say "  exit $?: $(tail -n 1 "$OUTDIR/deepspeed.jsonl" | head -c 300)"
  done
fi

if wants big; then
  say "big: tune gpt-2b on rtx4090-32g"
  t0="$(date +%s.%N)"
  bounded "${TUNE_TIMEOUT:-300}" "$BIN" tune --model gpt-2b --target rtx4090-32g -v \
    --record "$OUTDIR/gpt-2b.profile.json" --out "$OUTDIR/gpt-2b.plan.json" \
    > "$OUTDIR/tune-2b.stdout" 2> "$OUTDIR/tune-2b.log"
  rc=$?
  t1="$(date +%s.%N)"
  echo "{\"exit\": $rc, \"seconds\": $("$PYTHON" -c "print(round($t1 - $t0, 2))")}" > "$OUTDIR/tune-2b.time"
  say "  tune: $(cat "$OUTDIR/tune-2b.time")"
  grep -E 'plan:|  bf16' "$OUTDIR/tune-2b.log" | tail -20 >&2
  if [[ -f "$OUTDIR/gpt-2b.plan.json" ]]; then
    say "big: 20 steps with the plan"
    bounded 300 "$BIN" train --plan "$OUTDIR/gpt-2b.plan.json" --steps 20 \
      --data pattern --json > "$OUTDIR/train-2b.json" 2> "$OUTDIR/train-2b.log"
    say "  train: exit $?: $(head -c 400 "$OUTDIR/train-2b.json")"
  fi
fi

"$PYTHON" benches/gpu/offload_report.py "$OUTDIR" > "$OUTDIR/summary.md" 2>> "$OUTDIR/report.log"
cat "$OUTDIR/summary.md"
say "done"
