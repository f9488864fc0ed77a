#!/usr/bin/env bash
# engine_bench.sh — the engine's GPU checks and its comparison with PyTorch, in one run:
#
#   benches/gpu/engine_bench.sh OUTDIR
#
#   1. the CUDA tests (flash attention with and without key padding vs the CPU, the one-launch
#      Adam, the explicit engine and its kernels, padded cross-entropy included, vs the CPU),
#      output in OUTDIR/cuda_tests.txt, then the kernel timings bench (flash attention, the
#      fused ops, the host's time per op) in OUTDIR/cuda_timings.txt, and PyTorch's attention
#      at the bench's flash shapes (sdpa_ref.py) in OUTDIR/sdpa_ref.txt;
#   2. run.sh: the default engine and the materialised-attention engine against PyTorch eager on
#      $ROWS (default: seed bf16 32/128/512, seed fp32 128/512, gpt-124m bf16 4/16);
#   3. kernels.sh: one Nsight Compute kernel table per row of $KERNEL_ROWS for ours and PyTorch
#      (default gpt-124m bf16 16), where the time of a step goes.
#
# Needs the CUDA build in .gpu/ (cuda-build.sh --out .gpu, plus a copy of gpu-env.sh) and the
# test and bench binaries in .gpux/ (cuda-build.sh --out .gpux --test it --bench
# cuda_timings; only the `it-*` and `cuda_timings-*` files are needed). Environment: ROWS,
# KERNEL_ROWS ("MODEL:PRECISION:MB ..."; empty skips), TESTS (default: the groups above).
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -ne 1 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"
ROWS="${ROWS:-seed:bf16:32,128,512 seed:fp32:128,512 gpt-124m:bf16:4,16}"
KERNEL_ROWS="${KERNEL_ROWS-gpt-124m:bf16:16}"
TESTS="${TESTS:-cuda_attention cuda_explicit cuda_ops::cuda_backward cuda_ops::cuda_softmax cuda_ops::cuda_cross_entropy}"
stamp() { echo "engine_bench.sh [$(date -u +%H:%M:%S)] $*" >&2; }

TEST_BIN="$(ls .gpux/it-* 2>/dev/null | head -n 1)"
if [[ -n "$TEST_BIN" ]]; then
  source_gpu_env .gpu/gpu-env.sh "$ROOT/.gpu" "$ROOT/.gpux"
  stamp "CUDA tests: $TESTS"
  # shellcheck disable=SC2086
  bounded "${TEST_TIMEOUT:-300}" "$TEST_BIN" $TESTS --nocapture --test-threads=1 > "$OUTDIR/cuda_tests.txt" 2>&1
  stamp "CUDA tests: exit $?"
  grep -E "^test |test result|MISS|panicked" "$OUTDIR/cuda_tests.txt" >&2
else
  stamp "no test binary in .gpux/: skipping the CUDA tests"
fi
TIMINGS_BIN="$(ls .gpux/cuda_timings-* 2>/dev/null | head -n 1)"
if [[ -n "$TIMINGS_BIN" ]]; then
  source_gpu_env .gpu/gpu-env.sh "$ROOT/.gpu" "$ROOT/.gpux"
  bounded 120 "$TIMINGS_BIN" > "$OUTDIR/cuda_timings.txt" 2>&1
  stamp "kernel timings: exit $?"
  grep -E "^flash " "$OUTDIR/cuda_timings.txt" >&2
else
  stamp "no timings binary in .gpux/: skipping the kernel timings"
fi
"${TORCH_ENV[@]}" "$PYTHON" benches/gpu/sdpa_ref.py > "$OUTDIR/sdpa_ref.txt" 2>&1
stamp "PyTorch attention timings: exit $?"
grep -E "^sdpa " "$OUTDIR/sdpa_ref.txt" >&2

stamp "run.sh $ROWS"
# shellcheck disable=SC2086
EXTRA_ENGINES="${EXTRA_ENGINES-explicit-materialized}" benches/gpu/run.sh "$OUTDIR" $ROWS > /dev/null
stamp "run.sh: exit $?"

for row in $KERNEL_ROWS; do
  IFS=: read -r model precision mb <<< "$row"
  stamp "kernels $model $precision $mb"
  benches/gpu/kernels.sh "$OUTDIR" "$model" "$precision" "$mb" 2 > /dev/null
  benches/gpu/kernels.sh "$OUTDIR" "$model" "$precision" "$mb" 2 torch > /dev/null
done
stamp "done"
for f in "$OUTDIR"/table*.md; do echo "== $(basename "$f")"; cat "$f"; done
