#!/usr/bin/env bash
# tune_bench.sh — how good is `autotune tune` for one model on an emulated RTX 4090?
#
#   benches/gpu/tune_bench.sh OUTDIR MODEL
#   benches/gpu/tune_bench.sh /tmp/tb seed
#
# Stages (each command under `timeout`; a failure is recorded and the next stage runs):
#   tune     `autotune tune --target $DEVICE --json --out OUTDIR/MODEL.plan.json`, wall clock timed
#            (after an untimed tiny warm-up probe that fills the driver's PTX JIT cache)
#   finders  finders.py: Lightning's binsearch finder and Accelerate's find_executable_batch_size
#            under the same cap, then 6 timed steps at the batch each found
#   run      `autotune run --steps $RUN_STEPS` (tunes again, then trains): did it train without OOM?
#   grid     `autotune probe` over each regime of the search space: micro-batches 1,2,4,... up to
#            the first OOM, then the eighths between the last fit and that OOM (ascending, up to
#            the first OOM), within $GRID_SECONDS in total (a regime gets an even share of what
#            is left; points that would not finish in its share are recorded as skipped)
#   report   tune_report.py writes OUTDIR/MODEL.summary.md
# The grid runs last so that it takes what $BENCH_SECONDS leaves.
#
# Files (re-running a model overwrites its files):
#   MODEL.plan.json     the plan (or tune's "no feasible plan" answer)
#   MODEL.finders.jsonl one line per finder
#   MODEL.run.json      wall times and exit codes of tune and run, run's JSON report, OOM verdict
#   MODEL.grid.jsonl    one probe line per grid point ("regime" and "process_s" added), skips
#   MODEL.log           stderr of everything
#   MODEL.summary.md    the report
# The run's checkpoints go to a temporary directory, removed at the end (KEEP_RUN_DIR=1 keeps it).
#
# Environment (all optional):
#   BIN             autotune binary (default .gpu/autotune; target/debug/autotune for a CPU dry run)
#   DEVICE          target profile for tune/run (default rtx4090-32g; `cpu` for a CPU dry run)
#   PROBE_DEVICE    --device of the grid probes (default cuda; cpu when DEVICE=cpu)
#   GPU_CAPACITY    --gpu-capacity of grid probes (default 24564MiB, none on a CPU; empty = omit)
#   HOST_BUDGET     --host-budget of grid probes (default 32GiB)
#   REGIMES         grid regimes, PRECISION:CHECKPOINTING:OFFLOAD[:MB,MB,...] separated by spaces
#                   (default: the plan's search space: bf16 × {none,all} × {none,optimizer} on a
#                   GPU, fp32 × {none,all} × none on a CPU); a list of micro-batches replaces the
#                   doubling schedule for that regime (probed ascending, up to the first that
#                   does not fit), e.g. bf16:all:optimizer:1,64 for a slow regime
#   MAX_MB          largest grid micro-batch (default 1024, tune's --max-micro-batch default)
#   GRID_SECONDS    time for the whole grid (default 240)
#   GRID_WARMUP, GRID_STEPS   steps per grid probe (default 2 and 5)
#   BENCH_SECONDS   hard limit for this script: stage timeouts and the grid shrink to fit (default none)
#   FINDERS         finders to run (default lightning-binsearch,accelerate; empty = skip)
#   FINDER_CAP_MIB  PyTorch allocator cap for the finders (default 24052 = 24564 - 512 MiB context)
#   FINDER_ARGS     extra arguments for finders.py
#   RUN             1 = do the full run (default), 0 = skip
#   RUN_MODE        run (default: `autotune run`, tunes again) or train (`autotune train --plan`)
#   RUN_STEPS       optimizer steps of the full run (default 30)
#   TUNE_ARGS       extra arguments for tune and run (e.g. "--max-probes 20")
#   TUNE_TIMEOUT, RUN_TIMEOUT, PROBE_TIMEOUT, FINDER_TIMEOUT   seconds (default 420, 480, 120, 240)
#   GPU_ENV         gpu-env.sh to source (default: next to BIN, then ../shared/tools/gpu-env.sh)
#   PYTHON          python with torch, lightning and accelerate (default python3)
#   COMMIT          the commit to report (default: git rev-parse of the working tree, which is
#                   wrong when the tree was copied over an older checkout)
set -euo pipefail
export LC_NUMERIC=C   # awk and printf read and write decimal points
export NO_COLOR=1     # plain log lines (autotune's debug output is parsed from the log)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [[ $# -ne 2 ]] || help_asked "$@"; then usage; fi

MODEL="$2"
open_outdir "$1"

BIN="${BIN:-.gpu/autotune}"
DEVICE="${DEVICE:-rtx4090-32g}"
if [[ "$DEVICE" == cpu ]]; then PROBE_DEVICE="${PROBE_DEVICE:-cpu}"; else PROBE_DEVICE="${PROBE_DEVICE:-cuda}"; fi
# A CPU probe cannot emulate a GPU size.
if [[ "$PROBE_DEVICE" == cpu ]]; then GPU_CAPACITY="${GPU_CAPACITY-}"; else GPU_CAPACITY="${GPU_CAPACITY-24564MiB}"; fi
HOST_BUDGET="${HOST_BUDGET:-32GiB}"
MAX_MB="${MAX_MB:-1024}"
GRID_SECONDS="${GRID_SECONDS:-240}"
GRID_WARMUP="${GRID_WARMUP:-2}"
GRID_STEPS="${GRID_STEPS:-5}"
BENCH_SECONDS="${BENCH_SECONDS:-}"
FINDERS="${FINDERS-lightning-binsearch,accelerate}"
FINDER_CAP_MIB="${FINDER_CAP_MIB:-24052}"
RUN="${RUN:-1}"
RUN_MODE="${RUN_MODE:-run}"
RUN_STEPS="${RUN_STEPS:-30}"
TUNE_TIMEOUT="${TUNE_TIMEOUT:-420}"
RUN_TIMEOUT="${RUN_TIMEOUT:-480}"
PROBE_TIMEOUT="${PROBE_TIMEOUT:-120}"
FINDER_TIMEOUT="${FINDER_TIMEOUT:-240}"
read -r -a TUNE_EXTRA <<< "${TUNE_ARGS:-}"
read -r -a FINDER_EXTRA <<< "${FINDER_ARGS:-}"

PLAN="$OUTDIR/$MODEL.plan.json"
GRID="$OUTDIR/$MODEL.grid.jsonl"
FIND="$OUTDIR/$MODEL.finders.jsonl"
META="$OUTDIR/$MODEL.run.json"
LOG="$OUTDIR/$MODEL.log"
SUMMARY="$OUTDIR/$MODEL.summary.md"

need_bin "build it with cuda-build.sh --out .gpu, or set BIN"
[[ "$RUN_MODE" == run || "$RUN_MODE" == train ]] || { echo "tune_bench.sh: RUN_MODE must be run or train" >&2; exit 2; }
rm -f "$PLAN" "$GRID" "$FIND" "$META" "$SUMMARY"
: > "$LOG"
touch "$GRID" "$FIND"

TMP="$(mktemp -d "${TMPDIR:-/tmp}/tune-bench.XXXXXX")"

# ---- time keeping -----------------------------------------------------------------------
now() { date +%s.%N; }
# elapsed T0 [T1]: seconds from T0 to T1 (default now), 3 decimals
elapsed() { awk -v a="$1" -v b="${2:-$(now)}" 'BEGIN { printf "%.3f", b - a }'; }
START="$(now)"
# remaining: whole seconds left of BENCH_SECONDS (a large number when unset)
remaining() {
  if [[ -z "$BENCH_SECONDS" ]]; then echo 999999; return; fi
  awk -v s="$START" -v n="$(now)" -v l="$BENCH_SECONDS" 'BEGIN { r = l - (n - s); printf "%d", (r > 0 ? r : 0) }'
}
# limit DEFAULT: DEFAULT capped by what is left of BENCH_SECONDS, at least 1 (`timeout 0` would
# mean no limit at all)
limit() {
  local r; r="$(remaining)"
  (( r < $1 )) && { echo $(( r > 1 ? r : 1 )); return; }
  echo "$1"
}
say() { echo "tune_bench.sh [$MODEL $(elapsed "$START")s] $*" | tee -a "$LOG" >&2; }

# ---- libraries (as run.sh) --------------------------------------------------------------
# The finders run under TORCH_ENV (lib.sh), with the library path this script started with.
GPU_DIR="$(cd "$(dirname "$BIN")" && pwd)"
if [[ "$DEVICE" != cpu ]]; then
  gpu_libraries "$GPU_DIR" wheels
fi

# ---- meta data (MODEL.run.json), written at exit whatever happened ------------------------
TUNE_RC=""; TUNE_WALL=""; RUN_RC=""; RUN_WALL=""; GRID_WALL=""; GRID_BUDGET=""; FINDERS_WALL=""
write_meta() {
  # Stage records go through the environment; run's stdout/stderr through files.
  M_MODEL="$MODEL" M_DEVICE="$DEVICE" M_BIN="$BIN" M_TUNE_RC="$TUNE_RC" M_TUNE_WALL="$TUNE_WALL" \
  M_TUNE_ARGS="${TUNE_ARGS:-}" M_RUN="$RUN" M_RUN_MODE="$RUN_MODE" M_RUN_STEPS="$RUN_STEPS" \
  M_RUN_RC="$RUN_RC" M_RUN_WALL="$RUN_WALL" M_RUN_OUT="$TMP/run.out" M_RUN_ERR="$TMP/run.err" \
  M_GRID_WALL="$GRID_WALL" M_GRID_BUDGET="$GRID_BUDGET" M_GRID_SECONDS="$GRID_SECONDS" \
  M_FINDERS_WALL="$FINDERS_WALL" M_GPU_CAPACITY="$GPU_CAPACITY" M_HOST_BUDGET="$HOST_BUDGET" \
  M_TOTAL="$(elapsed "$START")" M_COMMIT="${COMMIT:-$(commit_id --short)}" M_GPU="$(gpu_line "")" \
  "$PYTHON" - "$META" <<'EOF' 2>> "$LOG" || echo "tune_bench.sh: could not write $META" >&2
import json, os, re, sys
e = os.environ
def num(k):
    v = e.get(k, "")
    try:
        return float(v) if "." in v else int(v)
    except ValueError:
        return None
def text(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
out, err = text(e["M_RUN_OUT"]), text(e["M_RUN_ERR"])
report = None
if out.strip():
    try:
        report = json.loads(out)
    except ValueError:
        # Keep the last JSON document if anything else reached stdout.
        for line in reversed(out.splitlines()):
            if line.startswith("{"):
                try:
                    report = json.loads(line); break
                except ValueError:
                    pass
ran = e["M_RUN"] == "1" and e["M_RUN_RC"] != ""
oom_pat = re.compile(r"out of memory|out_of_memory|OutOfMemory|CUDA_ERROR_OUT_OF_MEMORY|ALLOC_FAILED", re.I)
training = (report or {}).get("training") if isinstance(report, dict) else None
if ran and isinstance(report, dict) and "training" not in report and "steps" in report:
    training = report  # `train --json` prints the summary itself
rc = num("M_RUN_RC")
meta = {
    "model": e["M_MODEL"], "device": e["M_DEVICE"], "bin": e["M_BIN"], "commit": e["M_COMMIT"],
    "gpu": e["M_GPU"] or None, "tune_args": e["M_TUNE_ARGS"],
    "tune": {"exit_code": num("M_TUNE_RC"), "wall_s": num("M_TUNE_WALL")},
    "finders": {"wall_s": num("M_FINDERS_WALL")},
    "grid": {"wall_s": num("M_GRID_WALL"), "budget_s": num("M_GRID_BUDGET"),
             "grid_seconds": num("M_GRID_SECONDS"), "gpu_capacity": e["M_GPU_CAPACITY"] or None,
             "host_budget": e["M_HOST_BUDGET"]},
    "run": None,
    "total_s": num("M_TOTAL"),
}
if ran:
    meta["run"] = {
        "mode": e["M_RUN_MODE"], "steps_requested": num("M_RUN_STEPS"), "exit_code": rc,
        "wall_s": num("M_RUN_WALL"), "timed_out": rc in (124, 137),
        "oom": bool(oom_pat.search(err) or oom_pat.search(out)) and rc != 0,
        "steps_done": training.get("steps") if isinstance(training, dict) else None,
        "tokens_per_s": training.get("tokens_per_s") if isinstance(training, dict) else None,
        "knobs": training.get("knobs") if isinstance(training, dict) else None,
        "report": report, "stderr_tail": err.splitlines()[-15:],
    }
with open(sys.argv[1], "w") as f:
    json.dump(meta, f, indent=1)
    f.write("\n")
EOF
}
finish() {
  local rc=$?
  trap - EXIT
  write_meta
  "$PYTHON" benches/gpu/tune_report.py "$OUTDIR" "$MODEL" > /dev/null 2>> "$LOG" \
    || echo "tune_bench.sh: tune_report.py failed (see $LOG)" >&2
  [[ "${KEEP_RUN_DIR:-0}" == 1 ]] || rm -rf "$TMP"
  say "done (exit $rc); summary in $SUMMARY"
  exit "$rc"
}
trap finish EXIT
trap 'exit 143' TERM INT

say "BIN=$BIN DEVICE=$DEVICE PROBE_DEVICE=$PROBE_DEVICE GPU_CAPACITY=${GPU_CAPACITY:-none} HOST_BUDGET=$HOST_BUDGET GRID_SECONDS=$GRID_SECONDS BENCH_SECONDS=${BENCH_SECONDS:-none} TUNE_ARGS=${TUNE_ARGS:-}"

# ---- regimes of the grid ----------------------------------------------------------------
if [[ -n "${REGIMES:-}" ]]; then
  read -r -a REGIME_LIST <<< "$REGIMES"
elif [[ "$PROBE_DEVICE" == cpu ]]; then
  REGIME_LIST=(fp32:none:none fp32:all:none)
else
  REGIME_LIST=(bf16:none:none bf16:all:none bf16:none:optimizer bf16:all:optimizer)
fi
for r in "${REGIME_LIST[@]}"; do
  [[ "$r" =~ ^(fp32|bf16|fp16):(none|all|every-[0-9]+):(none|optimizer)(:[0-9]+(,[0-9]+)*)?$ ]] \
    || { echo "tune_bench.sh: bad regime '$r' (want PRECISION:none|all|every-K:none|optimizer[:MB,...])" >&2; exit 2; }
done
# The precisions the probes will use, for the warm-up.
declare -A PRECISIONS=()
for r in "${REGIME_LIST[@]}"; do PRECISIONS[${r%%:*}]=1; done

# ---- warm-up ----------------------------------------------------------------------------
# The binary's PTX is compiled by the driver at first load (~20 s) and cached; keep that out
# of the timed tune. One tiny run per precision, with and without checkpointing/offload.
for precision in "${!PRECISIONS[@]}"; do
  for extra in "" "--checkpointing all --offload optimizer"; do
    [[ "$PROBE_DEVICE" == cpu && -n "$extra" ]] && continue
    # shellcheck disable=SC2086
    warm_up "$(limit 180)" "$LOG" "$PROBE_DEVICE" "$precision" $extra \
      || say "warning: tiny $precision $extra warm-up failed (see log)"
  done
done
say "warm-up done"

# ---- (a) tune ---------------------------------------------------------------------------
say "tune: $BIN tune --model $MODEL --target $DEVICE --json --out $PLAN ${TUNE_EXTRA[*]}"
echo "== tune" >> "$LOG"
t0="$(now)"
TUNE_RC=0
timeout --kill-after=10 "$(limit "$TUNE_TIMEOUT")" "$BIN" tune --model "$MODEL" --target "$DEVICE" --json \
  --out "$PLAN" "${TUNE_EXTRA[@]}" > "$TMP/tune.out" 2>> "$LOG" || TUNE_RC=$?
TUNE_WALL="$(elapsed "$t0")"
if [[ ! -s "$PLAN" && -s "$TMP/tune.out" ]]; then
  # No feasible plan: keep tune's answer (feasible: false, evidence) in the plan's place.
  cp "$TMP/tune.out" "$PLAN"
fi
say "tune: exit $TUNE_RC in ${TUNE_WALL}s"

# ---- (c) finders ------------------------------------------------------------------------
if [[ -n "$FINDERS" ]]; then
  echo "== finders" >> "$LOG"
  t0="$(now)"
  ft="$(limit $(( 2 * FINDER_TIMEOUT + 60 )))"
  fc="$(limit "$FINDER_TIMEOUT")"
  if (( fc < 20 )); then
    say "finders: skipped (time)"
  else
    frc=0
    PYTHONUNBUFFERED=1 timeout --kill-after=10 "$ft" "${TORCH_ENV[@]}" "$PYTHON" benches/gpu/finders.py \
      --model "$MODEL" --precision bf16 --finders "$FINDERS" --cap-mib "$FINDER_CAP_MIB" \
      --timeout "$fc" --total-timeout "$(( ft > 10 ? ft - 10 : 1 ))" "${FINDER_EXTRA[@]}" >> "$FIND" 2>> "$LOG" || frc=$?
    FINDERS_WALL="$(elapsed "$t0")"
    say "finders: exit $frc in ${FINDERS_WALL}s"
    while IFS= read -r l; do say "  ${l:0:160}"; done < "$FIND"
  fi
fi

# ---- (d) the full run -------------------------------------------------------------------
# Other processes' memory shrinks the emulated card: wait (up to 30 s) until the finders'
# processes have released the GPU before training with the plan.
wait_for_idle_gpu() {
  local i used
  for i in $(seq 1 60); do
    used="$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n1 || echo 0)"
    (( ${used:-0} < 2048 )) && return 0
    sleep 0.5
  done
  say "warning: GPU still has ${used} MiB in use by other processes"
}
if [[ "$RUN" == 1 ]]; then
  wait_for_idle_gpu
  echo "== run" >> "$LOG"
  t0="$(now)"
  RUN_RC=0
  if [[ "$RUN_MODE" == train ]]; then
    cmd=("$BIN" train --plan "$PLAN" --steps "$RUN_STEPS" --data pattern --json)
  else
    cmd=("$BIN" run --model "$MODEL" --target "$DEVICE" --steps "$RUN_STEPS" --run-dir "$TMP/run-$MODEL" --json
         "${TUNE_EXTRA[@]}")
  fi
  say "run: ${cmd[*]}"
  timeout --kill-after=10 "$(limit "$RUN_TIMEOUT")" "${cmd[@]}" > "$TMP/run.out" 2> "$TMP/run.err" || RUN_RC=$?
  RUN_WALL="$(elapsed "$t0")"
  # Progress lines (one per step) are kept short in the log.
  grep -v '^step [0-9]*:' "$TMP/run.err" >> "$LOG" || true
  say "run: exit $RUN_RC in ${RUN_WALL}s$(grep -qiE 'out of memory|out_of_memory|OutOfMemory' "$TMP/run.err" "$TMP/run.out" && echo ' (out of memory reported)')"
fi

# ---- (b) the grid -----------------------------------------------------------------------
# probe_point LABEL PRECISION CKPT OFFLOAD MB: runs one probe, appends its line; sets OUTCOME
# (fits, out_of_memory, crashed, error, timeout) and POINT_S (process seconds).
probe_point() {
  local label="$1" precision="$2" ckpt="$3" offload="$4" mb="$5" t
  local args=(probe --model "$MODEL" --precision "$precision" --micro-batch "$mb" --warmup "$GRID_WARMUP"
              --steps "$GRID_STEPS" --device "$PROBE_DEVICE" --host-budget "$HOST_BUDGET" --json)
  [[ -n "$GPU_CAPACITY" ]] && args+=(--gpu-capacity "$GPU_CAPACITY")
  [[ "$ckpt" != none ]] && args+=(--checkpointing "$ckpt")
  [[ "$offload" != none ]] && args+=(--offload "$offload")
  echo "== grid $label mb=$mb: $BIN ${args[*]}" >> "$LOG"
  t="$(now)"
  timed_json "$(limit "$PROBE_TIMEOUT")" "$TMP/probe.out" "$LOG" "$BIN" "${args[@]}"
  POINT_S="$(elapsed "$t")"
  if [[ -n "$JSON_LINE" ]]; then
    OUTCOME="$(outcome_field "$JSON_LINE" | head -n 1 | sed 's/.*"\([a-z_]*\)"$/\1/')"
    [[ -n "$OUTCOME" ]] || OUTCOME=error
    echo "{\"regime\": \"$label\", \"process_s\": $POINT_S, ${JSON_LINE#\{}" >> "$GRID"
  else
    OUTCOME="$(no_json_outcome "$RC")"
    printf '{"regime": "%s", "process_s": %s, "impl": "autotune", "model": "%s", "precision": "%s", "micro_batch": %d, "request": {"knobs": {"micro_batch": %d, "grad_accum": 1, "precision": "%s", "checkpointing": %s, "offload": "%s"}}, "outcome": "%s", "exit_code": %d}\n' \
      "$label" "$POINT_S" "$MODEL" "$precision" "$mb" "$mb" "$precision" "$(ckpt_json "$ckpt")" "$offload" "$OUTCOME" "$RC" >> "$GRID"
  fi
  say "grid $label mb=$mb: $OUTCOME (${POINT_S}s)"
}
ckpt_json() {
  case "$1" in
    none) echo '{"mode": "none"}' ;;
    all) echo '{"mode": "every_kth", "k": 1}' ;;
    every-*) echo "{\"mode\": \"every_kth\", \"k\": ${1#every-}}" ;;
  esac
}
skip_point() {
  echo "{\"regime\": \"$1\", \"skipped\": \"grid time limit\", \"micro_batch\": $2}" >> "$GRID"
  say "grid $1 mb=$2: skipped (time limit)"
}
# fits_in DEADLINE EST: whether a probe expected to take EST seconds ends before DEADLINE
fits_in() { awk -v d="$1" -v n="$(now)" -v e="$2" 'BEGIN { exit !(n + e <= d) }'; }

# next_ok MB: whether a probe at MB should still start before the regime's deadline (estimate:
# the regime's last probe time scaled by the micro-batch; its first probe only needs time left)
next_ok() {
  local est=0
  [[ -n "$prev_s" ]] && est="$(awk -v s="$prev_s" -v a="$prev_mb" -v b="$1" 'BEGIN { printf "%.3f", s * (b > a ? b / a : 1) }')"
  fits_in "$deadline" "$est"
}

echo "== grid" >> "$LOG"
grid_t0="$(now)"
r="$(remaining)"
GRID_BUDGET="$GRID_SECONDS"
(( r - 5 < GRID_BUDGET )) && GRID_BUDGET=$(( r > 5 ? r - 5 : 0 ))
grid_end="$(awk -v s="$grid_t0" -v b="$GRID_BUDGET" 'BEGIN { printf "%.3f", s + b }')"
say "grid: ${#REGIME_LIST[@]} regimes within ${GRID_BUDGET}s"
left=${#REGIME_LIST[@]}
for regime in "${REGIME_LIST[@]}"; do
  IFS=: read -r precision ckpt offload listed <<< "$regime"
  label="$precision/ckpt=$ckpt/offload=$offload"
  # An even share of the time left; what a regime does not use passes on to the next.
  deadline="$(awk -v n="$(now)" -v e="$grid_end" -v k="$left" 'BEGIN { r = (e - n) / k; printf "%.3f", n + (r > 0 ? r : 0) }')"
  left=$(( left - 1 ))
  prev_s=""; prev_mb=""; last_fit=0; first_oom=0; stopped=0
  if [[ -n "$listed" ]]; then
    # The listed micro-batches only, ascending, up to the first that does not fit.
    for mb in $(tr ',' '\n' <<< "$listed" | sort -n -u); do
      if ! next_ok "$mb"; then skip_point "$label" "$mb"; break; fi
      probe_point "$label" "$precision" "$ckpt" "$offload" "$mb"
      [[ "$OUTCOME" == fits ]] || break
      prev_s="$POINT_S"; prev_mb="$mb"
    done
    continue
  fi
  mb=1
  while (( mb <= MAX_MB )); do
    if ! next_ok "$mb"; then skip_point "$label" "$mb"; stopped=1; break; fi
    probe_point "$label" "$precision" "$ckpt" "$offload" "$mb"
    # Time estimates scale from the last probe that ran all its steps.
    [[ "$OUTCOME" == fits || -z "$prev_s" ]] && { prev_s="$POINT_S"; prev_mb="$mb"; }
    if [[ "$OUTCOME" == fits ]]; then last_fit=$mb; mb=$(( mb * 2 )); continue; fi
    # Only an out-of-memory bounds the interval to refine; a crash or timeout ends the regime.
    [[ "$OUTCOME" == out_of_memory ]] && first_oom=$mb || stopped=1
    break
  done
  # Eighths of the interval between the last fit and the first OOM, ascending, up to an OOM.
  if (( stopped == 0 && last_fit > 0 && first_oom > last_fit )); then
    prev=$last_fit
    for k in 1 2 3 4 5 6 7; do
      mb=$(( last_fit + k * (first_oom - last_fit) / 8 ))
      (( mb <= prev || mb >= first_oom )) && continue
      prev=$mb
      if ! next_ok "$mb"; then skip_point "$label" "$mb"; break; fi
      probe_point "$label" "$precision" "$ckpt" "$offload" "$mb"
      [[ "$OUTCOME" == fits ]] || break
      prev_s="$POINT_S"; prev_mb="$mb"
    done
  fi
done
GRID_WALL="$(elapsed "$grid_t0")"
say "grid: $(grep -c '"outcome"' "$GRID" || true) probes in ${GRID_WALL}s"
