#!/usr/bin/env bash
# regimes.sh — memory-saving regimes on the GPU: `autotune probe` at bf16 for each model,
# regime (none / checkpointing all / offload optimizer / both) and micro-batch, with the
# GPU emulating an RTX 4090 (24564 MiB), then the offload step-time floor next to the
# measured step times (offload_floor.py).
#
#   benches/gpu/regimes.sh OUTDIR
#
# Writes OUTDIR/regimes.jsonl (one probe JSON line per run; runs that print none get an
# `error`/`timeout` line), OUTDIR/regimes.log (stderr of every run), OUTDIR/env.txt and
# OUTDIR/floor.md.
# Environment (all optional):
#   GPU_DIR          folder with the CUDA binary `autotune` (default .gpu)
#   GPU_ENV          gpu-env.sh to source (default: $GPU_DIR/gpu-env.sh, then ../shared/tools/gpu-env.sh)
#   MODELS           presets to run (default "gpt-124m gpt-350m"; add "seed" to see dropout's cost)
#   BATCHES          micro-batches (default "4 8")
#   CAPACITY         emulated GPU size (default 24564MiB)
#   WARMUP, STEPS    steps per probe (default 2 and 5)
#   TIMEOUT_PER_RUN  seconds per probe before it is killed (default 600)
#   PCIE_GBS         host<->GPU bandwidth for the floor, GB/s (default 25, PCIe 4.0 x16)
#   HOST_GBS         host memory bandwidth for the floor, GB/s (default 40)
#   PYTHON           python3 for offload_floor.py (standard library only)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [[ $# -ne 1 ]] || help_asked "$@"; then usage; fi

open_outdir "$1"

BIN="$GPU_DIR/autotune"
read -r -a MODEL_LIST <<< "${MODELS:-gpt-124m gpt-350m}"
read -r -a BATCH_LIST <<< "${BATCHES:-4 8}"
CAPACITY="${CAPACITY:-24564MiB}"
WARMUP="${WARMUP:-2}"
STEPS="${STEPS:-5}"
TIMEOUT_PER_RUN="${TIMEOUT_PER_RUN:-600}"
# checkpointing:offload pairs, cheapest in time first.
REGIMES=(none:none all:none none:optimizer all:optimizer)

need_bin "build it with cuda-build.sh --out $GPU_DIR"

# ---- libraries ------------------------------------------------------------------------
gpu_libraries "$GPU_DIR" dir

# ---- environment record ---------------------------------------------------------------
{
  record_header
  echo "models: ${MODEL_LIST[*]} batches: ${BATCH_LIST[*]} regimes: ${REGIMES[*]}"
  echo "capacity=$CAPACITY warmup=$WARMUP steps=$STEPS timeout=$TIMEOUT_PER_RUN"
  echo "cpus: $(nproc)"
  grep -m1 'model name' /proc/cpuinfo 2>/dev/null || true
  grep MemTotal /proc/meminfo 2>/dev/null || true
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  echo
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
    --format=csv 2>&1 || true
} > "$OUTDIR/env.txt"

JSONL="$OUTDIR/regimes.jsonl"
LOG="$OUTDIR/regimes.log"

# ---- warm the PTX JIT cache -----------------------------------------------------------
warm_up "$TIMEOUT_PER_RUN" "$LOG" cuda bf16 --checkpointing all --offload optimizer \
  || echo "regimes.sh: warning: tiny warm-up run failed (see $LOG)" >&2

# ---- the runs -------------------------------------------------------------------------
# One process per probe: an out-of-memory or a crash cannot leave state behind for the next.
for model in "${MODEL_LIST[@]}"; do
  for b in "${BATCH_LIST[@]}"; do
    for regime in "${REGIMES[@]}"; do
      IFS=: read -r ckpt offload <<< "$regime"
      echo "== $(date -u +%H:%M:%S) $model bf16 mb=$b ckpt=$ckpt offload=$offload" >> "$LOG"
      out="$(mktemp)"
      timed_json "$TIMEOUT_PER_RUN" "$out" "$LOG" "$BIN" probe --model "$model" --precision bf16 \
        --micro-batch "$b" --checkpointing "$ckpt" --offload "$offload" \
        --warmup "$WARMUP" --steps "$STEPS" --device cuda --gpu-capacity "$CAPACITY" --json
      rm -f "$out"
      if [[ -n "$JSON_LINE" ]]; then
        echo "$JSON_LINE" >> "$JSONL"
      else
        printf '{"impl": "autotune", "model": "%s", "precision": "bf16", "micro_batch": %d, "checkpointing": "%s", "offload": "%s", "outcome": "%s", "exit_code": %d}\n' \
          "$model" "$b" "$ckpt" "$offload" "$(no_json_outcome "$RC")" "$RC" >> "$JSONL"
      fi
      echo "regimes.sh: $model mb=$b ckpt=$ckpt offload=$offload: exit $RC${JSON_LINE:+, $(outcome_field "$JSON_LINE")}" >&2
    done
  done
done

"$PYTHON" benches/gpu/offload_floor.py --pcie-gbs "${PCIE_GBS:-25}" --host-gbs "${HOST_GBS:-40}" \
  "$JSONL" > "$OUTDIR/floor.md"
cat "$OUTDIR/floor.md"
