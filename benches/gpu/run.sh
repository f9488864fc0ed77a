#!/usr/bin/env bash
# run.sh — benchmark autotune's CUDA build against the PyTorch eager reference on
# the GPU of this machine. See benches/gpu/README.md.
#
#   benches/gpu/run.sh OUTDIR [MODEL:PRECISION:BATCHES ...]
#   benches/gpu/run.sh benches/results/h200 seed:bf16:32,128,512 gpt-124m:bf16:8,16
#
# Default specs: seed at fp32, bf16 and fp16 with micro-batches 32,128,512.
# Environment (all optional):
#   GPU_DIR           folder with the CUDA binary + bundled libcudart (default .gpu)
#   GPU_ENV           path of gpu-env.sh (default: $GPU_DIR/gpu-env.sh, then ../shared/tools/gpu-env.sh)
#   CAP_MIB           cap PyTorch's allocator at this many MiB (e.g. 24052 for a 24 GB card)
#   AUTOTUNE_ARGS     extra arguments for `autotune probe` (e.g. its own memory cap)
#   COMPILE_ROWS      "MODEL:PRECISION:MB ..." rows also measured under torch.compile, into
#                     pytorch-compile.jsonl and table-vs-compile.md
#   EXTRA_ENGINES     more `--engine`s to measure beside the default, each into
#                     autotune-ENGINE.jsonl and table-ENGINE.md (e.g. explicit-materialized)
#   TIMEOUT_PER_RUN   seconds per process before it is killed (default 120)
#   WARMUP, STEPS     steps per measurement (default 2 and 6)
#   PYTHON            python with torch (default python3)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [[ $# -lt 1 ]] || help_asked "$@"; then usage; fi

open_outdir "$1"; shift

BIN="$GPU_DIR/autotune"
TIMEOUT_PER_RUN="${TIMEOUT_PER_RUN:-120}"
WARMUP="${WARMUP:-2}"
STEPS="${STEPS:-6}"
read -r -a EXTRA_ARGS <<< "${AUTOTUNE_ARGS:-}"

if [[ $# -gt 0 ]]; then
  SPECS=("$@")
else
  SPECS=(seed:fp32:32,128,512 seed:bf16:32,128,512 seed:fp16:32,128,512)
fi

# Check every spec before spending GPU time on the first one.
for spec in "${SPECS[@]}"; do
  if [[ ! "$spec" =~ ^[a-z0-9.-]+:(fp32|bf16|fp16):[0-9]+(,[0-9]+)*$ ]]; then
    echo "run.sh: bad spec '$spec' (want MODEL:fp32|bf16|fp16:B1,B2,...)" >&2
    exit 2
  fi
done

need_bin "build it with cuda-build.sh --out $GPU_DIR"

# ---- libraries ------------------------------------------------------------------------
# PyTorch runs under TORCH_ENV (lib.sh), with the library path this script started with.
gpu_libraries "$GPU_DIR" wheels show

# ---- environment record ---------------------------------------------------------------
{
  record_header
  echo "specs: ${SPECS[*]}"
  echo "warmup=$WARMUP steps=$STEPS timeout=$TIMEOUT_PER_RUN cap_mib=${CAP_MIB:-none} autotune_args=${AUTOTUNE_ARGS:-}"
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  echo
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit,persistence_mode \
    --format=csv 2>&1 || true
  echo
  nvidia-smi 2>&1 || true
  echo
  "${TORCH_ENV[@]}" "$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 || true
  echo
  echo "ldd $BIN:"
  ldd "$BIN" 2>&1 || true
} > "$OUTDIR/env.txt"

# ---- one measurement ------------------------------------------------------------------
# run_one IMPL JSONL LOG MODEL PRECISION BATCH -- CMD...
# Runs CMD under `timeout`, appends its JSON line to JSONL. A process that printed no
# JSON (crash, timeout, loader error) still gets a line, so that the table shows the
# failure rather than a silent gap, and the loop goes on.
run_one() {
  local impl="$1" jsonl="$2" log="$3" model="$4" precision="$5" batch="$6"
  shift 7
  local out
  out="$(mktemp)"
  echo "== $(date -u +%H:%M:%S) $impl $model $precision mb=$batch: $*" >> "$log"
  timed_json "$TIMEOUT_PER_RUN" "$out" "$log" "$@"
  if [[ -n "$JSON_LINE" ]]; then
    echo "$JSON_LINE" >> "$jsonl"
  else
    printf '{"impl": "%s", "model": "%s", "precision": "%s", "micro_batch": %d, "seq_len": null, "outcome": "%s", "exit_code": %d, "step_time_median_s": null, "step_time_spread": null, "tokens_per_s": null, "peak_gpu_bytes": null, "peak_reserved_bytes": null, "timed_steps": 0, "params": null}\n' \
      "$impl" "$model" "$precision" "$batch" "$(no_json_outcome "$RC")" "$RC" >> "$jsonl"
  fi
  echo "   $impl $model $precision mb=$batch: exit $RC${JSON_LINE:+, $(outcome_field "$JSON_LINE")}" >&2
  rm -f "$out"
}

# ---- warm the PTX JIT cache -----------------------------------------------------------
# One untimed tiny run per precision (warm_up, lib.sh) keeps the driver's PTX compile out of the
# first real measurement (it happens in warm-up anyway, but can eat into the per-run timeout).
declare -A seen_precision=()
for spec in "${SPECS[@]}"; do
  IFS=: read -r _ precision _ <<< "$spec"
  [[ -n "${seen_precision[$precision]:-}" ]] && continue
  seen_precision[$precision]=1
  echo "run.sh: warming JIT cache ($precision)" >&2
  warm_up "$TIMEOUT_PER_RUN" "$OUTDIR/autotune.log" cuda "$precision" "${EXTRA_ARGS[@]}" \
    || echo "run.sh: warning: tiny $precision warm-up run failed (see autotune.log)" >&2
done

# ---- the benchmark --------------------------------------------------------------------
cap_args=()
[[ -n "${CAP_MIB:-}" ]] && cap_args=(--cap-mib "$CAP_MIB")

for spec in "${SPECS[@]}"; do
  IFS=: read -r model precision batches <<< "$spec"
  IFS=, read -r -a batch_list <<< "$batches"
  for b in "${batch_list[@]}"; do
    # One process per measurement for both sides: an OOM or a crash cannot leave
    # fragmented memory behind for the next one. Ours and PyTorch alternate so that
    # both see the same clocks, temperature and neighbours.
    run_one autotune "$OUTDIR/autotune.jsonl" "$OUTDIR/autotune.log" "$model" "$precision" "$b" -- \
      "$BIN" probe --model "$model" --precision "$precision" --micro-batch "$b" \
      --warmup "$WARMUP" --steps "$STEPS" --device cuda --json "${EXTRA_ARGS[@]}"
    for engine in ${EXTRA_ENGINES:-}; do
      run_one "autotune-$engine" "$OUTDIR/autotune-$engine.jsonl" "$OUTDIR/autotune.log" "$model" "$precision" "$b" -- \
        "$BIN" probe --model "$model" --precision "$precision" --micro-batch "$b" \
        --warmup "$WARMUP" --steps "$STEPS" --device cuda --json --engine "$engine" "${EXTRA_ARGS[@]}"
    done
    run_one pytorch "$OUTDIR/pytorch.jsonl" "$OUTDIR/pytorch.log" "$model" "$precision" "$b" -- \
      "${TORCH_ENV[@]}" "$PYTHON" benches/gpu/torch_ref.py --model "$model" --precision "$precision" --micro-batch "$b" \
      --warmup "$WARMUP" --steps "$STEPS" "${cap_args[@]}"
    if [[ " ${COMPILE_ROWS:-} " == *" $model:$precision:$b "* ]]; then
      run_one pytorch-compile "$OUTDIR/pytorch-compile.jsonl" "$OUTDIR/pytorch.log" "$model" "$precision" "$b" -- \
        "${TORCH_ENV[@]}" "$PYTHON" benches/gpu/torch_ref.py --model "$model" --precision "$precision" --micro-batch "$b" \
        --warmup "$WARMUP" --steps "$STEPS" --compile "${cap_args[@]}"
    fi
  done
done

"$PYTHON" benches/gpu/compare.py "$OUTDIR/autotune.jsonl" "$OUTDIR/pytorch.jsonl" > "$OUTDIR/table.md"
if [[ -s "$OUTDIR/pytorch-compile.jsonl" ]]; then
  "$PYTHON" benches/gpu/compare.py --ref pytorch-compile "$OUTDIR/autotune.jsonl" "$OUTDIR/pytorch-compile.jsonl" > "$OUTDIR/table-vs-compile.md"
  echo "against torch.compile:"; cat "$OUTDIR/table-vs-compile.md"
fi
for engine in ${EXTRA_ENGINES:-}; do
  "$PYTHON" benches/gpu/compare.py "$OUTDIR/autotune-$engine.jsonl" "$OUTDIR/pytorch.jsonl" > "$OUTDIR/table-$engine.md"
  echo "engine $engine:"; cat "$OUTDIR/table-$engine.md"
done
cat "$OUTDIR/table.md"
