#!/usr/bin/env bash
# llama_bench.sh — the Llama-family decoders on the GPU, PyTorch (transformers' own model) in the
# same call:
#
#   benches/gpu/llama_bench.sh OUTDIR [STAGE ...]
#
# Stages (default: all, in this order):
#   probe      `autotune probe` of llama-3.2-1b (mb 1, 2) and qwen2.5-0.5b (mb 2, 4), bf16, seq
#              2048, no memory cap (the same batches PyTorch runs) → OUTDIR/ours.jsonl
#   torch      benches/gpu/llama_ref.py at the same batches → OUTDIR/torch.jsonl
#   tune       `autotune tune --model llama-3.2-1b --target rtx4090-32g` (timed, recorded), then
#              20 training steps with the plan → OUTDIR/llama-3.2-1b.{plan,profile}.json,
#              tune.time, train.json
#   roundtrip  benches/hf/roundtrip.py on the GPU: a tiny Llama from transformers trains 10
#              steps and loads back → OUTDIR/roundtrip/summary.json
# then OUTDIR/summary.md (llama_report.py).
#
# Needs the CUDA build in .gpu/ and PyTorch with transformers. Environment: TUNE_TIMEOUT
# (default 300 s), PYTHON.
set -uo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -lt 1 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"
shift
STAGES="${*:-probe torch tune roundtrip}"
TUNE_TIMEOUT="${TUNE_TIMEOUT:-300}"
BIN="$GPU_DIR/autotune"
need_bin "build it with cuda-build.sh --out $GPU_DIR"
gpu_libraries "$GPU_DIR" wheels
record_header > "$OUTDIR/env.txt"
gpu_line >> "$OUTDIR/env.txt"
CASES=("llama-3.2-1b 1,2" "qwen2.5-0.5b 2,4")

if wants probe; then
  : > "$OUTDIR/ours.jsonl"
  for c in "${CASES[@]}"; do
    read -r model mbs <<< "$c"
    for mb in ${mbs//,/ }; do
      say "probe: $model mb $mb"
      timeout --kill-after=10 240 "$BIN" probe --model "$model" --precision bf16 \
        --micro-batch "$mb" --warmup 2 --steps 6 --device cuda --json \
        2>> "$OUTDIR/probe.log" | grep '^{' >> "$OUTDIR/ours.jsonl"
      say "  exit ${PIPESTATUS[0]}: $(tail -c 300 "$OUTDIR/ours.jsonl")"
    done
  done
fi

if wants torch; then
  : > "$OUTDIR/torch.jsonl"
  for c in "${CASES[@]}"; do
    read -r model mbs <<< "$c"
    say "torch: $model mb $mbs"
    "${TORCH_ENV[@]}" "$PYTHON" benches/gpu/llama_ref.py --model "$model" --seq 2048 \
      --micro-batch "$mbs" --warmup 2 --steps 6 >> "$OUTDIR/torch.jsonl" 2>> "$OUTDIR/torch.log"
    say "  exit $?"
  done
  tail -8 "$OUTDIR/torch.log" >&2
fi

if wants tune; then
  model=llama-3.2-1b
  say "tune: $model on rtx4090-32g"
  t0="$(date +%s.%N)"
  bounded "$TUNE_TIMEOUT" "$BIN" tune --model "$model" --target rtx4090-32g -v \
    --record "$OUTDIR/$model.profile.json" --out "$OUTDIR/$model.plan.json" \
    > "$OUTDIR/tune.stdout" 2> "$OUTDIR/tune.log"
  rc=$?
  t1="$(date +%s.%N)"
  echo "{\"exit\": $rc, \"seconds\": $("$PYTHON" -c "print(round($t1 - $t0, 2))")}" > "$OUTDIR/tune.time"
  say "  tune: exit $rc, $(cat "$OUTDIR/tune.time")"
  grep -E '^\[|plan:|trials' "$OUTDIR/tune.log" | tail -30 >&2
  if [[ -f "$OUTDIR/$model.plan.json" ]]; then
    say "train: 20 steps with the plan"
    bounded 300 "$BIN" train --plan "$OUTDIR/$model.plan.json" --steps 20 \
      --data pattern --json > "$OUTDIR/train.json" 2> "$OUTDIR/train.log"
    say "  train: exit $?: $(head -c 400 "$OUTDIR/train.json")"
  fi
fi

if wants roundtrip; then
  say "roundtrip: transformers → autotune (10 steps on cuda) → transformers"
  "${TORCH_ENV[@]}" "$PYTHON" benches/hf/roundtrip.py "$OUTDIR/roundtrip" --bin "$BIN" \
    --device cuda > "$OUTDIR/roundtrip.log" 2>&1
  say "  exit $?"
  grep -E '^(PASS|FAIL)' "$OUTDIR/roundtrip.log" >&2
fi

"$PYTHON" benches/gpu/llama_report.py "$OUTDIR" > "$OUTDIR/summary.md" 2>> "$OUTDIR/report.log"
cat "$OUTDIR/summary.md"
say "done"
