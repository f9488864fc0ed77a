#!/usr/bin/env bash
# packing_bench.sh — packed against padded fine-tuning on a chat dataset, transformers padded in
# the same call:
#
#   benches/gpu/packing_bench.sh OUTDIR [STAGE ...]
#
# Stages (default: all, in this order):
#   data    benches/data/make_chat.py: a llama-3.2-1b-shaped folder (Llama-3-style tokenizer of
#           32,000 tokens, Llama 3.1's template) and CONVERSATIONS chat conversations of varied
#           lengths → OUTDIR/work/ (not kept: regenerated from the seed)
#   tests   the CUDA tests of packed attention and rotary positions → OUTDIR/cuda_tests.txt
#   ours    `autotune train` bf16, micro-batch MB, STEPS steps, packed (the default) and
#           --no-pack → OUTDIR/{packed,padded}.{json,metrics.jsonl}
#   torch   benches/gpu/padded_ref.py at the same micro-batch → OUTDIR/torch.jsonl
# then OUTDIR/summary.json: real (non-pad) tokens/s of each over the steps after WARMUP.
#
# Needs the CUDA build (autotune and the `it` test binary) in .gpu/ and PyTorch with
# transformers. Environment: CONVERSATIONS (10000), MB (4), STEPS (30), WARMUP (5), PYTHON.
set -uo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -lt 1 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"
shift
STAGES="${*:-data tests ours torch}"
CONVERSATIONS="${CONVERSATIONS:-10000}"
MB="${MB:-4}"
STEPS="${STEPS:-30}"
WARMUP="${WARMUP:-5}"
BIN="$GPU_DIR/autotune"
WORK="$OUTDIR/work"
need_bin "build it with cuda-build.sh --out $GPU_DIR --bin autotune --test it"
gpu_libraries "$GPU_DIR" wheels
record_header > "$OUTDIR/env.txt"
gpu_line >> "$OUTDIR/env.txt"

if wants data; then
  say "data: $CONVERSATIONS conversations"
  "${TORCH_ENV[@]}" "$PYTHON" benches/data/make_chat.py "$WORK" --conversations "$CONVERSATIONS" \
    > "$OUTDIR/data.json" 2>> "$OUTDIR/data.log"
  say "  $(cat "$OUTDIR/data.json")"
fi

if wants tests; then
  say "tests"
  IT="$(ls "$GPU_DIR"/it-* | head -1)"
  timeout 300 "$IT" cuda_attention::cuda_packed cuda_attention::cuda_flash_attention_matches \
    cuda_ops::cuda_decoder_ops --test-threads=1 > "$OUTDIR/cuda_tests.txt" 2>&1
  say "  exit $?: $(grep 'test result' "$OUTDIR/cuda_tests.txt")"
fi

if wants ours; then
  for mode in packed padded; do
    flag=(); [[ $mode == padded ]] && flag=(--no-pack)
    say "ours: $mode"
    rm -f "$OUTDIR/$mode.metrics.jsonl"
    bounded 400 "$BIN" train --model "$WORK/model" --data "$WORK/chat.jsonl" \
      --device cuda --precision bf16 --micro-batch "$MB" --steps "$STEPS" "${flag[@]}" \
      --cache-dir "$WORK/cache" --metrics "$OUTDIR/$mode.metrics.jsonl" --json \
      > "$OUTDIR/$mode.json" 2> "$OUTDIR/$mode.log"
    say "  exit $?: $(tail -c 400 "$OUTDIR/$mode.json")"
  done
fi

if wants torch; then
  say "torch: padded"
  "${TORCH_ENV[@]}" "$PYTHON" benches/gpu/padded_ref.py --model "$WORK/model" \
    --data "$WORK/chat.jsonl" --micro-batch "$MB" --warmup "$WARMUP" --steps "$((STEPS - WARMUP))" \
    > "$OUTDIR/torch.jsonl" 2> "$OUTDIR/torch.log"
  say "  exit $?: $(cat "$OUTDIR/torch.jsonl")"
fi

"$PYTHON" - "$OUTDIR" "$WARMUP" <<'PY' > "$OUTDIR/summary.json"
import json, pathlib, sys
out, warmup = pathlib.Path(sys.argv[1]), int(sys.argv[2])
summary = {}
for mode in ["packed", "padded"]:
    path = out / f"{mode}.metrics.jsonl"
    if not path.exists():
        continue
    lines = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    timed = [(prev, cur) for prev, cur in zip(lines, lines[1:]) if cur["step"] > warmup]
    seconds = sum(c["unix_time_s"] - p["unix_time_s"] for p, c in timed)
    real = sum(c.get("real_tokens_per_s", c["tokens_per_s"]) * (c["unix_time_s"] - p["unix_time_s"]) for p, c in timed)
    every = sum(c["tokens_per_s"] * (c["unix_time_s"] - p["unix_time_s"]) for p, c in timed)
    summary[mode] = {"real_tokens_per_s": real / seconds if seconds else None,
                     "tokens_per_s": every / seconds if seconds else None,
                     "steps_timed": len(timed), "last_loss": lines[-1]["loss"] if lines else None,
                     "gpu_peak_bytes": lines[-1]["gpu_peak_bytes"] if lines else None}
torch = out / "torch.jsonl"
if torch.exists() and torch.read_text().strip():
    summary["transformers_padded"] = json.loads(torch.read_text().splitlines()[-1])
p = summary.get("packed", {}).get("real_tokens_per_s")
for ref in ["padded", "transformers_padded"]:
    r = summary.get(ref, {}).get("real_tokens_per_s")
    if p and r:
        summary[f"packed_vs_{ref}"] = p / r
print(json.dumps(summary, indent=2))
PY
cat "$OUTDIR/summary.json" >&2
