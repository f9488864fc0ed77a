#!/usr/bin/env bash
# strongest_stack.sh — the engine against the strongest PyTorch stacks, the card capped at 24 GB
# on both sides, in one call:
#
#   benches/gpu/strongest_stack.sh OUTDIR [STAGE ...]
#
# Stages (default: all, in this order):
#   ours     `autotune probe` of llama-3.2-1b at bf16, mb $LLAMA_OURS_MB (default 2,3; 3 is the
#            tuned plan's batch), two rounds → OUTDIR/ours-llama.jsonl
#   liger    benches/gpu/llama_ref.py --liger --compile (transformers + Liger's RoPE, RMSNorm,
#            SwiGLU and fused linear cross-entropy, under torch.compile) at mb $LLAMA_REF_MB
#            (default 2,3,4,6; empty skips it) → OUTDIR/liger-compile.jsonl, then with every
#            block recomputed (transformers' gradient checkpointing, what a user short of
#            memory turns on) at mb $LLAMA_REF_RECOMPUTE_MB (default 4,8,12; empty skips it)
#            → OUTDIR/liger-compile-recompute.jsonl
#   gpt      gpt-124m b16 bf16: `autotune probe` and torch.compile (benches/gpu/run.sh with
#            COMPILE_ROWS) → OUTDIR/gpt-124m/
# then OUTDIR/summary.md (strongest_report.py).
#
# Needs the CUDA build in .gpu/, PyTorch with transformers, and Liger's wheel in WHEELS (default
# .whl; `pip download --no-deps liger-kernel`), installed into a scratch folder. Environment:
# WHEELS, PYTHON, CAP_MIB (PyTorch's cap, default 24052), CAPACITY (ours, default 24564MiB).
set -uo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -lt 1 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"
shift
STAGES="${*:-ours liger gpt}"
WHEELS="${WHEELS:-.whl}"
CAP_MIB="${CAP_MIB:-24052}"
CAPACITY="${CAPACITY:-24564MiB}"
LLAMA_OURS_MB="${LLAMA_OURS_MB:-2,3}"
LLAMA_REF_MB="${LLAMA_REF_MB-2,3,4,6}"
LLAMA_REF_RECOMPUTE_MB="${LLAMA_REF_RECOMPUTE_MB-4,8,12}"
BIN="$GPU_DIR/autotune"
need_bin "build it with cuda-build.sh --out $GPU_DIR"
record_header > "$OUTDIR/env.txt"
gpu_line >> "$OUTDIR/env.txt"

if wants liger; then
  site="$(mktemp -d)"
  if ! compgen -G "$WHEELS/liger_kernel-*.whl" > /dev/null; then
    say "liger: no $WHEELS/liger_kernel-*.whl; the stage is skipped"
  elif "${TORCH_ENV[@]}" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$site" "$WHEELS"/liger_kernel-*.whl >&2; then
    say "liger: $(basename "$WHEELS"/liger_kernel-*.whl) installed"
    for pass in plain recompute; do
      batches="$LLAMA_REF_MB"; name=liger-compile; flags=()
      if [[ "$pass" == recompute ]]; then
        batches="$LLAMA_REF_RECOMPUTE_MB"; name=liger-compile-recompute; flags=(--checkpointing)
      fi
      [[ -z "$batches" ]] && continue
      say "liger: llama-3.2-1b mb $batches ($pass)"
      "${TORCH_ENV[@]}" PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=10 420 \
        "$PYTHON" benches/gpu/llama_ref.py --model llama-3.2-1b --seq 2048 \
        --micro-batch "$batches" --warmup 4 --steps 8 --cap-mib "$CAP_MIB" --liger --compile \
        "${flags[@]}" > "$OUTDIR/$name.jsonl" 2> "$OUTDIR/$name.log"
      say "  exit $?: $(grep -c '^{' "$OUTDIR/$name.jsonl") rows"
    done
  fi
fi

( gpu_libraries "$GPU_DIR" wheels
  if wants ours; then
    : > "$OUTDIR/ours-llama.jsonl"
    for round in 1 2; do
      for mb in ${LLAMA_OURS_MB//,/ }; do
        say "ours: llama-3.2-1b mb $mb round $round"
        timeout --kill-after=10 240 "$BIN" probe --model llama-3.2-1b --precision bf16 \
          --micro-batch "$mb" --warmup 3 --steps 10 --device cuda --gpu-capacity "$CAPACITY" \
          --json 2>> "$OUTDIR/ours-llama.log" | grep '^{' >> "$OUTDIR/ours-llama.jsonl"
        say "  exit ${PIPESTATUS[0]}"
      done
    done
  fi )

if wants gpt; then
  say "gpt: gpt-124m b16, ours and torch.compile"
  CAP_MIB="$CAP_MIB" AUTOTUNE_ARGS="--gpu-capacity $CAPACITY" EXTRA_ENGINES="" \
    COMPILE_ROWS="gpt-124m:bf16:16" WARMUP=3 STEPS=10 \
    benches/gpu/run.sh "$OUTDIR/gpt-124m" gpt-124m:bf16:16 2> "$OUTDIR/gpt-124m.log"
  say "  exit $?"
fi

"$PYTHON" benches/gpu/strongest_report.py "$OUTDIR" > "$OUTDIR/summary.md" \
  || say "summary failed"
say "done: $OUTDIR/summary.md"
