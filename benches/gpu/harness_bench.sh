#!/usr/bin/env bash
# harness_bench.sh — tuning through the PyTorch harness (`tune --backend exec`) on the emulated
# RTX 4090 (24564 MiB + 32 GiB host), judged against PyTorch itself, in one call of at most
# about 8 minutes on an H200:
#
#   benches/gpu/harness_bench.sh OUTDIR
#
# Per model (gpt-124m first: both headline metrics are its), each stage within the time left:
#   tune     `autotune tune --model M --target rtx4090-32g --backend exec -v --record ... -- python3
#            harness/examples/{gpt,seed}_runner.py`, wall clock timed → M.plan.json, M.profile.json,
#            M.tune.{log,time}; then its four exports, without --allow-engine-mismatch →
#            M.{deepspeed,trainer,lightning}.json, M.accelerate.yaml, M.exports.json (exit codes)
#   exact    PyTorch's exact largest feasible micro-batch at the plan's knobs, by bisection with
#            real steps through the same runner, cap and allocator setting (harness_exact.py),
#            then every micro-batch from the plan's to that boundary (--scan: feasibility need
#            not be monotone) → M.exact.json; with EXACT_DEFAULT=1, the same under PyTorch's
#            default allocator → M.exact-default.json
#   finders  Lightning's binsearch finder and Accelerate's finder on the same model and cap
#            (finders.py) → M.finders.jsonl
#   train    20 steps with the DeepSpeed export (deepspeed.initialize with it as it is) and with the
#            Trainer export (HfArgumentParser + transformers.Trainer), on the same model and cap,
#            with the environment line the exports print (harness_train.py)
#            → M.train-{deepspeed,trainer}.json
# then summary.md, summary.json and headline.json (harness_report.py).
#
# Expected times on the H200 (each stage's limit in brackets; the whole run stops starting stages
# at BENCH_SECONDS): DeepSpeed install ~20 s; gpt-124m: tune ~40-70 s [150], exact ~80 s [150] (a fresh process per trial),
# finders ~60 s [100], train ~30 s each, the first DeepSpeed one ~60 s more for its FusedAdam op,
# built in the background during `exact` [90 each]; seed: tune ~20-40 s [90], exact ~30 s [60],
# finders ~50 s [80], train ~20 s each [60 each].
#
# Needs: the autotune binary (BIN, default .gpu/autotune; the exec backend opens no GPU itself, so
# a CPU build works too), python3 with torch, transformers, accelerate and lightning (the GPU
# machine's image has them), and DeepSpeed 0.19.8 as wheels in WHEELS (default .whl; see
# benches/gpu/README.md). Without the wheels the DeepSpeed stage is skipped and offloaded
# regimes answer `unsupported`.
#
# Environment (optional): MODELS (default "gpt-124m seed"), DEVICE (default rtx4090-32g),
# BENCH_SECONDS (default 470), CONTEXT_MIB (default 512: the memory counted outside PyTorch's
# allocator, so that its cap is 24564 - 512 = 24052 MiB as the finders' and earlier references'
# are), STEPS (default 20), EXTRA_TUNE_ARGS, WHEELS, PYTHON, BIN, FINDERS (default
# "lightning-binsearch,accelerate"; empty skips them), EXACT (default 1; empty skips the exact
# stage, for a call that measures the tune and the finders alone).
#
# An offloaded trial, if the search runs one, builds DeepSpeed's CPU Adam at first use (about a
# minute, once): the tune's log shows it.
#
# CPU dry run of the script itself (no GPU, DeepSpeed or finders; torch, transformers and
# accelerate in PYTHON; about 2.5 minutes on two cores):
#   BIN=target/debug/autotune PYTHON=/path/to/python-with-torch DEVICE=cpu MODELS=tiny FINDERS= \
#     WHEELS=/none STEPS=4 EXTRA_TUNE_ARGS="--max-micro-batch 16" benches/gpu/harness_bench.sh /tmp/hb
set -uo pipefail
export LC_NUMERIC=C
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [[ $# -ne 1 ]] || help_asked "$@"; then usage; fi
open_outdir "$1"

MODELS="${MODELS:-gpt-124m seed}"
DEVICE="${DEVICE:-rtx4090-32g}"
BENCH_SECONDS="${BENCH_SECONDS:-470}"
CONTEXT_MIB="${CONTEXT_MIB:-512}"
STEPS="${STEPS:-20}"
WHEELS="${WHEELS:-.whl}"
FINDERS="${FINDERS-lightning-binsearch,accelerate}"
EXACT="${EXACT-1}"
EXACT_DEFAULT="${EXACT_DEFAULT:-}"
BIN="${BIN:-$GPU_DIR/autotune}"
read -r -a EXTRA <<< "${EXTRA_TUNE_ARGS:-}"
need_bin "build it with cuda-build.sh --out $GPU_DIR, or cargo build --release and BIN=target/release/autotune"
# The CUDA build finds its libraries; PyTorch (the runner, started by autotune) gets the library
# path this script started with through TORCH_ENV.
if [[ -d "$GPU_DIR" ]]; then gpu_libraries "$GPU_DIR" wheels; fi
export AUTOTUNE_HARNESS_CONTEXT_BYTES=$(( CONTEXT_MIB * 1048576 ))
export NCCL_NVLS_ENABLE=0

# left: seconds of the bench left. stage_limit WANT: WANT, or what is left less a reserve for the
# report, whichever is smaller; 0 when too little is left to start a stage.
left() { echo $(( BENCH_SECONDS - ($(date +%s) - START) )); }
stage_limit() {
  local want="$1" l
  l=$(( $(left) - 10 ))
  if (( l < 15 )); then echo 0; elif (( l < want )); then echo "$l"; else echo "$want"; fi
}

# ---- the environment ---------------------------------------------------------------------
torch_version="$("${TORCH_ENV[@]}" "$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)"
{
  record_header
  gpu_line none
  echo "device=$DEVICE models=$MODELS context_mib=$CONTEXT_MIB bench_seconds=$BENCH_SECONDS"
  "${TORCH_ENV[@]}" "$PYTHON" -c 'import sys, torch, transformers, accelerate; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__)' 2>&1
  "${TORCH_ENV[@]}" "$PYTHON" -c 'import lightning; print("lightning", lightning.__version__)' 2>&1
  "$BIN" --version
} > "$OUTDIR/env.txt"

# ---- DeepSpeed from the wheels -------------------------------------------------------------
ds_version=""
if compgen -G "$WHEELS/deepspeed-*.tar.gz" > /dev/null; then
  say "deepspeed: install from $WHEELS"
  site=/tmp/ds-site
  {
    "${TORCH_ENV[@]}" "$PYTHON" -m pip install -q --no-index --no-deps --upgrade --target "$site" "$WHEELS"/*.whl
    DS_BUILD_OPS=0 "${TORCH_ENV[@]}" "$PYTHON" -m pip install -q --no-index --no-deps --upgrade \
      --no-build-isolation --target "$site" "$WHEELS"/deepspeed-*.tar.gz
  } > "$OUTDIR/deepspeed-install.log" 2>&1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  ds_version="$("${TORCH_ENV[@]}" "$PYTHON" -c 'import deepspeed; print(deepspeed.__version__)' 2>> "$OUTDIR/deepspeed-install.log")"
  say "  deepspeed ${ds_version:-did not install (see deepspeed-install.log)}"
  # DeepSpeed's op builder reads TORCH_CUDA_ARCH_LIST and fails on an arch with a letter
  # (9.0a): name this GPU's plain compute capability.
  if [[ "$DEVICE" != cpu ]]; then
    TORCH_CUDA_ARCH_LIST="$("${TORCH_ENV[@]}" "$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)"
    export TORCH_CUDA_ARCH_LIST
  fi
else
  say "deepspeed: no $WHEELS/deepspeed-*.tar.gz; its stage is skipped, offloaded regimes are unsupported"
fi
"$PYTHON" - "$OUTDIR/meta.json" "$MODELS" "$DEVICE" "$CONTEXT_MIB" "$torch_version" "$ds_version" \
  "$(commit_id --short)" "$(gpu_line none)" "$(utc_now)" <<'EOF'
import json, sys
out, models, device, ctx, torch, ds, commit, gpu, date = sys.argv[1:]
caps = {"rtx4090-32g": 24564}
json.dump({"models": models.split(), "device": device, "context_mib": int(ctx),
           "allocator_cap_mib": caps[device] - int(ctx) if device in caps else None,
           "torch": torch, "deepspeed": ds or None, "commit": commit, "gpu": gpu, "date": date},
          open(out, "w"), indent=1)
EOF

ds_prebuild_pid=""
# ds_prebuild: build DeepSpeed's FusedAdam op (the optimizer of a DeepSpeed config without
# offload) in the background, where no stage is timed for a headline.
ds_prebuild() {
  [[ -n "$ds_version" && -z "$ds_prebuild_pid" && "$DEVICE" != cpu ]] || return 0
  say "deepspeed: building FusedAdam in the background"
  "${TORCH_ENV[@]}" "$PYTHON" -c 'from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()' \
    > "$OUTDIR/deepspeed-fused-adam.log" 2>&1 &
  ds_prebuild_pid=$!
}

# DeepSpeed's CPU Adam (what an offloaded trial runs) is built once before anything is timed,
# as an installation that has run DeepSpeed before has it: a tune must not pay for its compile.
if [[ -n "$ds_version" ]]; then
  say "deepspeed: building CPUAdam"
  "${TORCH_ENV[@]}" "$PYTHON" -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' \
    > "$OUTDIR/deepspeed-cpu-adam.log" 2>&1
  say "  exit $?"
fi

# ---- one model ---------------------------------------------------------------------------
runner_of() { if [[ "$1" == seed ]]; then echo harness/examples/seed_runner.py; else echo harness/examples/gpt_runner.py; fi; }

bench_model() {
  local model="$1" runner limit rc t0 t1 is_gpt=0
  runner="$(runner_of "$model")"
  [[ "$model" == seed ]] || is_gpt=1

  limit="$(stage_limit $(( is_gpt ? 150 : 90 )))"
  if (( limit == 0 )); then say "$model: no time left"; return 0; fi
  say "$model: tune (limit ${limit}s)"
  t0="$(date +%s.%N)"
  bounded "$limit" "$BIN" tune --model "$model" --target "$DEVICE" --backend exec -v \
    --record "$OUTDIR/$model.profile.json" --out "$OUTDIR/$model.plan.json" "${EXTRA[@]}" \
    -- "${TORCH_ENV[@]}" "$PYTHON" "$runner" > "$OUTDIR/$model.tune.stdout" 2> "$OUTDIR/$model.tune.log"
  rc=$?
  t1="$(date +%s.%N)"
  echo "{\"exit\": $rc, \"seconds\": $("$PYTHON" -c "print(round($t1 - $t0, 2))")}" > "$OUTDIR/$model.tune.time"
  say "  tune: $(cat "$OUTDIR/$model.tune.time")"
  grep -E '^\[|plan:' "$OUTDIR/$model.tune.log" | tail -30 >&2
  [[ -f "$OUTDIR/$model.plan.json" ]] || return 0

  local f ext codes=""
  for f in deepspeed trainer lightning accelerate; do
    ext=json; [[ "$f" == accelerate ]] && ext=yaml
    "$BIN" export --plan "$OUTDIR/$model.plan.json" --format "$f" > "$OUTDIR/$model.$f.$ext" 2>> "$OUTDIR/$model.exports.log"
    codes="$codes${codes:+, }\"$f\": $?"
  done
  echo "{$codes}" > "$OUTDIR/$model.exports.json"
  say "  exports: $(cat "$OUTDIR/$model.exports.json")"

  ds_prebuild
  limit="$(stage_limit $(( is_gpt ? 150 : 60 )))"
  if [[ -n "$EXACT" ]] && (( limit > 0 )); then
    say "$model: exact boundary (limit ${limit}s)"
    bounded $(( limit + 30 )) "${TORCH_ENV[@]}" "$PYTHON" benches/gpu/harness_exact.py \
      --plan "$OUTDIR/$model.plan.json" --profile "$OUTDIR/$model.profile.json" \
      --out "$OUTDIR/$model.exact.json" --total-timeout "$limit" \
      --log "$OUTDIR/$model.exact.log" --scan -- "$PYTHON" "$runner" 2>> "$OUTDIR/$model.exact.log"
    say "  exact: exit $?: $(grep -o '"feasible_max": [0-9]*' "$OUTDIR/$model.exact.json" 2>/dev/null)"
  fi
  # The same boundary under PyTorch's default allocator, for comparison with the plan's setting.
  limit="$(stage_limit $(( is_gpt ? 150 : 60 )))"
  if [[ -n "$EXACT_DEFAULT" ]] && (( limit > 0 )); then
    say "$model: exact boundary under PyTorch's default allocator (limit ${limit}s)"
    bounded $(( limit + 30 )) "${TORCH_ENV[@]}" "$PYTHON" benches/gpu/harness_exact.py \
      --plan "$OUTDIR/$model.plan.json" --profile "$OUTDIR/$model.profile.json" --allocator default \
      --out "$OUTDIR/$model.exact-default.json" --total-timeout "$limit" \
      --log "$OUTDIR/$model.exact-default.log" --scan -- "$PYTHON" "$runner" 2>> "$OUTDIR/$model.exact-default.log"
    say "  exact (default allocator): exit $?: $(grep -o '"feasible_max": [0-9]*' "$OUTDIR/$model.exact-default.json" 2>/dev/null)"
  fi

  limit="$(stage_limit $(( is_gpt ? 100 : 80 )))"
  if [[ -n "$FINDERS" && "$DEVICE" != cpu ]] && (( limit > 0 )); then
    say "$model: finders (limit ${limit}s)"
    bounded $(( limit + 20 )) "${TORCH_ENV[@]}" "$PYTHON" benches/gpu/finders.py \
      --model "$model" --precision bf16 --finders "$FINDERS" --cap-mib $(( 24564 - CONTEXT_MIB )) \
      --total-timeout "$limit" > "$OUTDIR/$model.finders.jsonl" 2> "$OUTDIR/$model.finders.log"
    say "  finders: exit $?"
    cat "$OUTDIR/$model.finders.jsonl" >&2
  fi

  # The training runs as the exports tell a user to: with the environment line they print.
  local tool extra line plan_env=()
  line="$(grep -o 'environment: [A-Z_]*=[^ ]*' "$OUTDIR/$model.exports.log" 2>/dev/null | head -n 1 | cut -d' ' -f2)"
  [[ -n "$line" ]] && plan_env=(env "$line") && say "  training with $line, as the exports say"
  for tool in deepspeed trainer; do
    if [[ "$tool" == deepspeed && -z "$ds_version" ]]; then continue; fi
    if [[ "$tool" == deepspeed && -n "$ds_prebuild_pid" ]]; then
      wait "$ds_prebuild_pid"; say "  FusedAdam build: exit $?"; ds_prebuild_pid=done
    fi
    limit="$(stage_limit 90)"
    (( limit > 0 )) || continue
    say "$model: $STEPS steps with the $tool export (limit ${limit}s)"
    extra=()
    [[ "$tool" == trainer ]] && extra=(--deepspeed-config "$OUTDIR/$model.deepspeed.json")
    bounded "$limit" "${TORCH_ENV[@]}" "${plan_env[@]}" "$PYTHON" benches/gpu/harness_train.py --tool "$tool" \
      --plan "$OUTDIR/$model.plan.json" --config "$OUTDIR/$model.$tool.json" --steps "$STEPS" \
      --out "$OUTDIR/$model.train-$tool.json" "${extra[@]}" > /dev/null 2> "$OUTDIR/$model.train-$tool.log"
    say "  $tool: exit $?: $(head -c 400 "$OUTDIR/$model.train-$tool.json" 2>/dev/null)"
    # DeepSpeed builds its FusedAdam op with nvcc at first use; where that fails, the same
    # config with PyTorch's AdamW (torch_adam) still shows whether the setting fits.
    if [[ "$tool" == deepspeed ]] && grep -qiE '"error": "[^"]*(fused_?adam|ninja|nvcc|op_builder|jit)' \
        "$OUTDIR/$model.train-$tool.json" 2>/dev/null && (( $(stage_limit 90) > 0 )); then
      say "  deepspeed: the optimizer op did not build; again with torch_adam"
      mv "$OUTDIR/$model.train-$tool.json" "$OUTDIR/$model.train-$tool.first.json"
      bounded "$(stage_limit 90)" "${TORCH_ENV[@]}" "${plan_env[@]}" "$PYTHON" benches/gpu/harness_train.py \
        --tool deepspeed --torch-adam --plan "$OUTDIR/$model.plan.json" --config "$OUTDIR/$model.deepspeed.json" \
        --steps "$STEPS" --out "$OUTDIR/$model.train-$tool.json" > /dev/null 2>> "$OUTDIR/$model.train-$tool.log"
      say "  deepspeed (torch_adam): exit $?: $(head -c 400 "$OUTDIR/$model.train-$tool.json" 2>/dev/null)"
    fi
  done
}

for model in $MODELS; do
  bench_model "$model"
done
[[ -z "$ds_prebuild_pid" || "$ds_prebuild_pid" == done ]] || kill "$ds_prebuild_pid" 2>/dev/null

"$PYTHON" benches/gpu/harness_report.py "$OUTDIR" > "$OUTDIR/summary.md" 2>> "$OUTDIR/report.log"
cat "$OUTDIR/summary.md"
say "done"
