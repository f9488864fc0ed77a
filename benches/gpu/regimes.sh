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

if [[ $# -ne 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi

# Work from the repo root so that relative paths (.gpu/, benches/) resolve the same way
# whatever directory the script is started from.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$1"
OUTDIR="$(cd "$1" && pwd)"
cd "$ROOT"

GPU_DIR="${GPU_DIR:-.gpu}"
BIN="$GPU_DIR/autotune"
read -r -a MODEL_LIST <<< "${MODELS:-gpt-124m gpt-350m}"
read -r -a BATCH_LIST <<< "${BATCHES:-4 8}"
CAPACITY="${CAPACITY:-24564MiB}"
WARMUP="${WARMUP:-2}"
STEPS="${STEPS:-5}"
TIMEOUT_PER_RUN="${TIMEOUT_PER_RUN:-600}"
PYTHON="${PYTHON:-python3}"
# checkpointing:offload pairs, cheapest in time first.
REGIMES=(none:none all:none none:optimizer all:optimizer)

[[ -x "$BIN" ]] || { echo "regimes.sh: $BIN not found or not executable (build it with cuda-build.sh --out $GPU_DIR)" >&2; exit 2; }

# ---- libraries ------------------------------------------------------------------------
GPU_ENV="${GPU_ENV:-}"
if [[ -z "$GPU_ENV" ]]; then
  for cand in "$GPU_DIR/gpu-env.sh" ../shared/tools/gpu-env.sh; do
    [[ -f "$cand" ]] && { GPU_ENV="$cand"; break; }
  done
fi
if [[ -n "$GPU_ENV" ]]; then
  # gpu-env.sh is written for interactive shells: source it with strict mode off.
  set +euo pipefail
  # shellcheck disable=SC1090
  source "$GPU_ENV" "$(cd "$GPU_DIR" && pwd)"
  set -euo pipefail
else
  export LD_LIBRARY_PATH="$(cd "$GPU_DIR" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# ---- environment record ---------------------------------------------------------------
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -srm)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
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
# The first load of the binary's PTX compiles it (~15 s); keep that out of the first probe.
timeout "$TIMEOUT_PER_RUN" "$BIN" probe --model tiny --precision bf16 --micro-batch 2 \
  --checkpointing all --offload optimizer --warmup 1 --steps 1 --device cuda --json \
  > /dev/null 2>> "$LOG" || echo "regimes.sh: warning: tiny warm-up run failed (see $LOG)" >&2

# ---- the runs -------------------------------------------------------------------------
# One process per probe: an out-of-memory or a crash cannot leave state behind for the next.
for model in "${MODEL_LIST[@]}"; do
  for b in "${BATCH_LIST[@]}"; do
    for regime in "${REGIMES[@]}"; do
      IFS=: read -r ckpt offload <<< "$regime"
      echo "== $(date -u +%H:%M:%S) $model bf16 mb=$b ckpt=$ckpt offload=$offload" >> "$LOG"
      out="$(mktemp)"
      rc=0
      timeout --kill-after=10 "$TIMEOUT_PER_RUN" "$BIN" probe --model "$model" --precision bf16 \
        --micro-batch "$b" --checkpointing "$ckpt" --offload "$offload" \
        --warmup "$WARMUP" --steps "$STEPS" --device cuda --gpu-capacity "$CAPACITY" --json \
        > "$out" 2>> "$LOG" || rc=$?
      line="$(grep '^{' "$out" | tail -n 1 || true)"
      rm -f "$out"
      if [[ -n "$line" ]]; then
        echo "$line" >> "$JSONL"
      else
        outcome=error
        [[ $rc -eq 124 || $rc -eq 137 ]] && outcome=timeout
        printf '{"impl": "autotune", "model": "%s", "precision": "bf16", "micro_batch": %d, "checkpointing": "%s", "offload": "%s", "outcome": "%s", "exit_code": %d}\n' \
          "$model" "$b" "$ckpt" "$offload" "$outcome" "$rc" >> "$JSONL"
      fi
      echo "regimes.sh: $model mb=$b ckpt=$ckpt offload=$offload: exit $rc${line:+, $(grep -o '"outcome": *"[a-z_]*"' <<< "$line" || true)}" >&2
    done
  done
done

"$PYTHON" benches/gpu/offload_floor.py --pcie-gbs "${PCIE_GBS:-25}" --host-gbs "${HOST_GBS:-40}" \
  "$JSONL" > "$OUTDIR/floor.md"
cat "$OUTDIR/floor.md"
