#!/usr/bin/env bash
# compact_bench.sh — compact optimizer state on the GPU: llama-3.1-8b on the 24 GB card, with
# torchtune's single-device full fine-tune recipe in the same call:
#
#   benches/gpu/compact_bench.sh OUTDIR [STAGE ...]
#
# Stages (default: all, in this order):
#   kernel     the compact update's CUDA kernel against its CPU reference (`it` test binary)
#   bnb        tests/fixtures/bnb/generate.py: bitsandbytes' 8-bit AdamW on fixed tensors
#              → OUTDIR/bnb_adamw8bit.json (copied to tests/fixtures/bnb/ to compare in CI)
#   probe      `autotune probe` of llama-3.1-8b, bf16, every block recomputed, update in
#              backward, 8-bit moments in host memory, bf16 masters rounded stochastically,
#              under a 24564 MiB cap, at micro-batches $MBS → OUTDIR/ours.jsonl (+ host peak)
#   torchtune  benches/gpu/torchtune_ref.py at batches $TT_BATCHES, same sequence and cap
#              → OUTDIR/torchtune.json
#   tune       `autotune tune --model llama-3.1-8b --target rtx4090-32g --allow-compact-state`
#              (timed, recorded), then $TRAIN_STEPS training steps with the plan on learnable
#              data → OUTDIR/llama-3.1-8b.{plan,profile}.json, tune.time, train.json
#
# Needs the CUDA build in .gpu/ (with the `it` test binary) and the wheels in $WHEELS (default
# .whl: torchtune, torchao, omegaconf, bitsandbytes; see benches/gpu/README.md). Environment:
# MBS (default "1 2 4"), TT_BATCHES (default 1,2,4), TT_FLAGS (more torchtune_ref.py flags,
# e.g. --fraction-only), SEQ (default 2048), TUNE_TIMEOUT (300),
# TRAIN_STEPS (20), KERNEL_TESTS (the `it` tests to run, default compact_state::), PYTHON.
set -uo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -lt 1 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"
shift
STAGES="${*:-kernel bnb probe torchtune tune}"
MBS="${MBS:-1 2 4}"
TT_BATCHES="${TT_BATCHES:-1,2,4}"
SEQ="${SEQ:-2048}"
TUNE_TIMEOUT="${TUNE_TIMEOUT:-300}"
TRAIN_STEPS="${TRAIN_STEPS:-20}"
WHEELS="${WHEELS:-.whl}"
CAP=24564MiB
BIN="$GPU_DIR/autotune"
need_bin "build it with cuda-build.sh --out $GPU_DIR --bin autotune --test it"
gpu_libraries "$GPU_DIR" wheels
record_header > "$OUTDIR/env.txt"
gpu_line >> "$OUTDIR/env.txt"
SITE=/tmp/compact_site
if wants bnb || wants torchtune; then
  mapfile -t wheels < <(ls "$WHEELS"/{torchtune,torchao,omegaconf,antlr4,bitsandbytes}*.whl \
    2> /dev/null)
  "${TORCH_ENV[@]}" "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" \
    "${wheels[@]}" >> "$OUTDIR/pip.log" 2>&1 || say "pip: see pip.log"
fi
py() { PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "${TORCH_ENV[@]}" "$PYTHON" "$@"; }
COMPACT=(--precision bf16 --checkpointing all --update in-backward --moments int8
  --masters bf16-sr --moments-on host)

if wants kernel; then
  say "kernel: CUDA update against the CPU reference"
  it="$(ls "$GPU_DIR"/it-* | head -1)"
  "$it" "${KERNEL_TESTS:-compact_state::}" --test-threads 1 > "$OUTDIR/kernel.log" 2>&1
  say "  exit $?: $(grep 'test result' "$OUTDIR/kernel.log")"
fi

if wants bnb; then
  say "bnb: bitsandbytes' 8-bit AdamW fixture"
  py tests/fixtures/bnb/generate.py "$OUTDIR/bnb_adamw8bit.json" > "$OUTDIR/bnb.log" 2>&1
  say "  exit $?"
fi

if wants probe; then
  : > "$OUTDIR/ours.jsonl"
  for mb in $MBS; do
    say "probe: llama-3.1-8b mb $mb"
    /usr/bin/time -f '{"max_rss_kib": %M}' -o "$OUTDIR/probe-$mb.rss" \
      timeout --kill-after=10 300 "$BIN" probe --model llama-3.1-8b "${COMPACT[@]}" \
      --micro-batch "$mb" --warmup 1 --steps 4 --gpu-capacity "$CAP" --device cuda --json \
      2>> "$OUTDIR/probe.log" | grep '^{' >> "$OUTDIR/ours.jsonl"
    say "  exit ${PIPESTATUS[0]}: $(tail -c 400 "$OUTDIR/ours.jsonl") $(cat "$OUTDIR/probe-$mb.rss")"
  done
fi

if wants torchtune; then
  say "torchtune: llama-3.1-8b batches $TT_BATCHES"
  # shellcheck disable=SC2086  # TT_FLAGS holds several flags
  py benches/gpu/torchtune_ref.py --sweep "$TT_BATCHES" --seq "$SEQ" --warmup 2 --steps 5 \
    --cap-mib 24564 ${TT_FLAGS:-} --out "$OUTDIR/torchtune.json" > /dev/null \
    2> "$OUTDIR/torchtune.log"
  say "  exit $?"
  tail -5 "$OUTDIR/torchtune.log" >&2
fi

if wants tune; then
  model=llama-3.1-8b
  say "tune: $model on rtx4090-32g with compact state"
  t0="$(date +%s.%N)"
  bounded "$TUNE_TIMEOUT" "$BIN" tune --model "$model" --target rtx4090-32g \
    --allow-compact-state -v --record "$OUTDIR/$model.profile.json" \
    --out "$OUTDIR/$model.plan.json" > "$OUTDIR/tune.stdout" 2> "$OUTDIR/tune.log"
  rc=$?
  t1="$(date +%s.%N)"
  echo "{\"exit\": $rc, \"seconds\": $("$PYTHON" -c "print(round($t1 - $t0, 2))")}" > "$OUTDIR/tune.time"
  say "  tune: exit $rc, $(cat "$OUTDIR/tune.time")"
  grep -E '^\[|plan:|trials' "$OUTDIR/tune.log" | tail -30 >&2
  if [[ -f "$OUTDIR/$model.plan.json" ]]; then
    say "train: $TRAIN_STEPS steps with the plan"
    /usr/bin/time -f '{"max_rss_kib": %M}' -o "$OUTDIR/train.rss" \
      bounded 400 "$BIN" train --plan "$OUTDIR/$model.plan.json" \
      --steps "$TRAIN_STEPS" --data pattern --json \
      > "$OUTDIR/train.json" 2> "$OUTDIR/train.log"
    say "  train: exit $?, $(tail -c 400 "$OUTDIR/train.json") $(cat "$OUTDIR/train.rss")"
  fi
fi
say "done"
