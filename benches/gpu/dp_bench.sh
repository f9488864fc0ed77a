#!/usr/bin/env bash
# dp_bench.sh — data parallelism on the GPUs of one host: do N GPUs train what one GPU trains,
# and how well does throughput scale?
#
#   benches/gpu/dp_bench.sh OUTDIR
#   benches/gpu/dp_bench.sh benches/results/$(date +%Y-%m-%d)-h200x8-data-parallel
#
# For every degree N in $DEGREES (1 first; only degrees up to the visible GPU count):
#   train   `autotune train --data-parallel N` for $STEPS steps with the SAME global batch
#           ($GLOBAL sequences: micro-batch $MB per GPU, accumulation GLOBAL/(MB·N)), same seed
#           and data; losses are compared step by step with the one-GPU run
#   probe   `autotune probe --data-parallel N` (one micro-batch per GPU per step): tokens/s and
#           peak GPU memory per GPU, measured on N GPUs; scaling efficiency
#           = tokens/s(N) / (N · tokens/s(1))
#   shard   the same probe with --shard-optimizer (ZeRO-1): peak GPU memory per GPU must drop
# then `report` writes OUTDIR/summary.md with PASS/FAIL lines and the script exits 1 on any FAIL.
#
# Self-checks (FAIL): every command exits 0 and every probe fits; N > 1 runs use NCCL (the
# binary was built with --features nccl); every logged loss, the last loss and the final eval
# loss of N GPUs are within $LOSS_TOL (relative) of one GPU's; sharding lowers peak GPU memory.
# Scaling efficiency below $MIN_EFFICIENCY is reported as WARN (a measurement, not a defect).
#
# NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is exported for every command and
# recorded in env.txt (the lent multi-GPU machines must not use it).
#
# Files: env.txt, train-N.json (train's JSON report), train-N.log (its stderr: rank start lines,
# "step k: loss …" progress), probes.jsonl (one probe line per run, "degree"/"sharded" added),
# probe-*.log, summary.md. With TUNE=1 also tune.plan.json, tune.log and
# tune.deepspeed.json: a data-parallel search at the same global batch and its export.
#
# Environment (all optional):
#   BIN             autotune built with nccl (default .gpu/autotune; see benches/gpu/README.md)
#   MODEL           model preset or JSON spec (default gpt-124m)
#   PRECISION       default bf16
#   MB              micro-batch per GPU (default 8)
#   DEGREES         degrees to run (default "1 2 4 8", cut to the visible GPUs; 1 is always run)
#   GLOBAL          global batch (default MB × the largest degree run)
#   STEPS           training steps per degree (default 40); progress is logged every STEPS/10
#   DATA, SEED      training data and seed (default pattern, 0)
#   PROBE_WARMUP, PROBE_STEPS   steps per probe (default 2, 8)
#   LOSS_TOL        relative loss tolerance against one GPU (default 0.01; bf16, and the sum
#                   over ranks associates differently from one GPU's accumulation)
#   MIN_EFFICIENCY  scaling efficiency below this is a WARN (default 0.7)
#   TIMEOUT         seconds per command (default 600)
#   TUNE            1 = also run a data-parallel `tune` (default 0)
#   GPU_ENV         gpu-env.sh to source (default: next to BIN, then ../shared/tools/gpu-env.sh)
#   PYTHON          default python3
#   DEVICE          cuda (default), or cpu for a dry run of this script without GPUs
#                   (BIN=target/debug/autotune DEVICE=cpu MODEL=tiny CPU_RANKS=2: CPU ranks over
#                   TCP, so the checks expect tcp instead of nccl)
set -euo pipefail
export LC_NUMERIC=C
export NCCL_NVLS_ENABLE=0
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [[ $# -ne 1 ]] || help_asked "$@"; then usage; fi

open_outdir "$1"

BIN="${BIN:-.gpu/autotune}"
MODEL="${MODEL:-gpt-124m}"
PRECISION="${PRECISION:-bf16}"
MB="${MB:-8}"
STEPS="${STEPS:-40}"
DATA="${DATA:-pattern}"
SEED="${SEED:-0}"
PROBE_WARMUP="${PROBE_WARMUP:-2}"
PROBE_STEPS="${PROBE_STEPS:-8}"
LOSS_TOL="${LOSS_TOL:-0.01}"
MIN_EFFICIENCY="${MIN_EFFICIENCY:-0.7}"
TIMEOUT="${TIMEOUT:-600}"
TUNE="${TUNE:-0}"
DEVICE="${DEVICE:-cuda}"
if [[ "$DEVICE" == cpu ]]; then COLLECTIVES=tcp; else COLLECTIVES=nccl; fi

need_bin "build it as benches/gpu/README.md says, or set BIN"
LOG="$OUTDIR/bench.log"
: > "$LOG"
say() { echo "dp_bench.sh: $*" | tee -a "$LOG" >&2; }

# ---- libraries (as tune_bench.sh) --------------------------------------------------------
# No fallback without gpu-env.sh; on a CPU only a GPU_ENV given explicitly is sourced.
GPU_DIR="$(cd "$(dirname "$BIN")" && pwd)"
GPU_ENV="${GPU_ENV:-}"
[[ "$DEVICE" == cpu ]] || find_gpu_env "$GPU_DIR"
if [[ -n "$GPU_ENV" ]]; then
  source_gpu_env "$GPU_ENV" "$GPU_DIR"
fi
if ldd "$BIN" 2>/dev/null | grep -q 'libnccl.*not found'; then
  say "FAIL: $BIN needs libnccl.so.2, which is not on the library path (pip install nvidia-nccl-cu12, or point LD_LIBRARY_PATH at it)"
  exit 1
fi

# ---- the GPUs -----------------------------------------------------------------------------
if [[ "$DEVICE" == cpu ]]; then
  GPUS="${CPU_RANKS:-2}"
else
  GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
  [[ "$GPUS" -ge 1 ]] || { say "FAIL: no GPU visible (nvidia-smi -L)"; exit 1; }
fi
RUN_DEGREES=(1)
for d in ${DEGREES:-1 2 4 8}; do
  if [[ "$d" -gt 1 && "$d" -le "$GPUS" ]]; then RUN_DEGREES+=("$d"); fi
done
LARGEST="${RUN_DEGREES[-1]}"
GLOBAL="${GLOBAL:-$(( MB * LARGEST ))}"
for d in "${RUN_DEGREES[@]}"; do
  if (( GLOBAL % (MB * d) != 0 )); then
    say "FAIL: GLOBAL=$GLOBAL is not a multiple of MB × $d = $(( MB * d ))"; exit 2
  fi
done
say "$GPUS GPUs visible; degrees ${RUN_DEGREES[*]}; $MODEL $PRECISION, $MB sequences per GPU, global batch $GLOBAL"

{
  echo "date: $(utc_now)"
  echo "commit: ${COMMIT:-$(commit_id)}"
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
  echo "bin: $BIN"
  echo "model=$MODEL precision=$PRECISION mb=$MB global=$GLOBAL steps=$STEPS data=$DATA seed=$SEED"
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  echo "--- ldd"; ldd "$BIN" 2>&1 | grep -E 'nccl|cuda|cublas' || true
  echo "--- nvidia-smi"; nvidia-smi 2>&1 || true
  echo "--- nvidia-smi topo -m"; nvidia-smi topo -m 2>&1 || true
} > "$OUTDIR/env.txt"

# ---- one untimed run fills the driver's PTX JIT cache -------------------------------------
say "warm-up (PTX JIT cache)"
warm_up "$TIMEOUT" "$LOG" "$DEVICE" "$PRECISION" || say "warm-up probe failed (see bench.log)"

PROBES="$OUTDIR/probes.jsonl"
: > "$PROBES"
STATUS="$OUTDIR/status.txt"
: > "$STATUS"

dp_flags() { if [[ "$1" -gt 1 ]]; then echo "--data-parallel $1"; fi; }

for d in "${RUN_DEGREES[@]}"; do
  accum=$(( GLOBAL / (MB * d) ))
  say "train: $d GPU(s), micro-batch $MB, accumulation $accum"
  # shellcheck disable=SC2046
  set +e
  timeout "$TIMEOUT" "$BIN" train --model "$MODEL" --device "$DEVICE" --precision "$PRECISION" \
    --micro-batch "$MB" --grad-accum "$accum" $(dp_flags "$d") --steps "$STEPS" \
    --eval-every "$STEPS" --data "$DATA" --seed "$SEED" --json \
    > "$OUTDIR/train-$d.json" 2> "$OUTDIR/train-$d.log"
  rc=$?
  set -e
  echo "train $d $rc" >> "$STATUS"
  for sharded in 0 1; do
    [[ "$sharded" == 1 && "$d" == 1 ]] && continue
    extra=(); [[ "$sharded" == 1 ]] && extra=(--shard-optimizer)
    say "probe: $d GPU(s)$([[ $sharded == 1 ]] && echo ', sharded optimizer')"
    set +e
    # shellcheck disable=SC2046
    line="$(timeout "$TIMEOUT" "$BIN" probe --model "$MODEL" --device "$DEVICE" --precision "$PRECISION" \
      --micro-batch "$MB" $(dp_flags "$d") "${extra[@]}" --warmup "$PROBE_WARMUP" \
      --steps "$PROBE_STEPS" --json 2> "$OUTDIR/probe-$d-$sharded.log")"
    rc=$?
    set -e
    echo "probe $d $sharded $rc" >> "$STATUS"
    D="$d" S="$sharded" "$PYTHON" -c '
import json, os, sys
try:
    row = json.loads(sys.argv[1])
except ValueError:
    row = {"outcome": "error"}
row["degree"] = int(os.environ["D"]); row["sharded"] = os.environ["S"] == "1"
print(json.dumps(row))' "$line" >> "$PROBES"
  done
done

if [[ "$TUNE" == 1 ]]; then
  say "tune: data-parallel search at global batch $GLOBAL"
  set +e
  timeout "$(( TIMEOUT * 3 ))" "$BIN" tune --model "$MODEL" --target auto --precision "$PRECISION" \
    --global-batch "$GLOBAL" --json --out "$OUTDIR/tune.plan.json" > /dev/null 2> "$OUTDIR/tune.log"
  echo "tune 0 0 $?" >> "$STATUS"
  "$BIN" export --plan "$OUTDIR/tune.plan.json" --format deepspeed > "$OUTDIR/tune.deepspeed.json" 2>> "$LOG"
  set -e
fi

# ---- report -------------------------------------------------------------------------------
set +e
OUTDIR="$OUTDIR" LOSS_TOL="$LOSS_TOL" MIN_EFFICIENCY="$MIN_EFFICIENCY" MODEL="$MODEL" \
PRECISION="$PRECISION" MB="$MB" GLOBAL="$GLOBAL" DEGREES="${RUN_DEGREES[*]}" \
COLLECTIVES="$COLLECTIVES" "$PYTHON" - <<'EOF'
import json, os, re

out = os.environ["OUTDIR"]
tol = float(os.environ["LOSS_TOL"])
min_eff = float(os.environ["MIN_EFFICIENCY"])
degrees = [int(d) for d in os.environ["DEGREES"].split()]
checks = []  # (verdict, text)

def check(ok, text, warn=False):
    checks.append(("PASS" if ok else ("WARN" if warn else "FAIL"), text))

status = {}
for line in open(os.path.join(out, "status.txt")):
    parts = line.split()
    status[tuple(parts[:-1])] = int(parts[-1])

def train_run(d):
    report, losses = None, {}
    try:
        report = json.load(open(os.path.join(out, f"train-{d}.json")))
    except (OSError, ValueError):
        pass
    log = open(os.path.join(out, f"train-{d}.log"), errors="replace").read()
    for m in re.finditer(r"^step (\d+): loss ([0-9.]+)", log, re.M):
        losses[int(m.group(1))] = float(m.group(2))
    return report, losses, log

runs = {d: train_run(d) for d in degrees}
probes = [json.loads(l) for l in open(os.path.join(out, "probes.jsonl")) if l.strip()]
probe = {(p["degree"], p["sharded"]): p for p in probes}

for d in degrees:
    report, losses, log = runs[d]
    check(status.get(("train", str(d))) == 0 and report is not None,
          f"train on {d} GPU(s) exits 0 with a JSON report")
    if d > 1:
        c = os.environ["COLLECTIVES"]
        check(f"{c} collectives" in log, f"train on {d} GPUs uses {c} (for nccl: binary built with --features nccl)")
    for s in ([False] if d == 1 else [False, True]):
        p = probe.get((d, s), {})
        check(p.get("outcome") == "fits", f"probe on {d} GPU(s){' sharded' if s else ''} fits")

base_report, base_losses, _ = runs[1]
rows = []
for d in degrees:
    report, losses, _ = runs[d]
    worst = None
    if d > 1 and base_report and report:
        common = sorted(set(losses) & set(base_losses))
        pairs = [(losses[k], base_losses[k]) for k in common]
        for key in ("last_loss", "last_eval_loss"):
            if report.get(key) is not None and base_report.get(key) is not None:
                pairs.append((report[key], base_report[key]))
        rel = [abs(a - b) / abs(b) for a, b in pairs if b]
        worst = max(rel) if rel else None
        check(bool(rel) and worst <= tol,
              f"{d} GPUs: {len(rel)} losses within {tol:.1%} of one GPU's (worst {worst if worst is None else f'{worst:.2e}'})")
    p1, pd, ps = probe.get((1, False), {}), probe.get((d, False), {}), probe.get((d, True), {})
    t1, td = p1.get("tokens_per_s"), pd.get("tokens_per_s")
    eff = td / (d * t1) if (t1 and td) else None
    if d > 1:
        check(eff is not None and eff >= min_eff,
              f"{d} GPUs: scaling efficiency {eff if eff is None else f'{eff:.3f}'} (>= {min_eff} expected)", warn=True)
        # On a CPU dry run the ranks' memory is host memory.
        key = "peak_host_bytes" if os.environ["COLLECTIVES"] == "tcp" else "peak_gpu_bytes"
        g, gs = pd.get(key), ps.get(key)
        check(g is not None and gs is not None and gs < g,
              f"{d} GPUs: sharding lowers {key} ({g} -> {gs} bytes)")
    train_tps = report.get("tokens_per_s") if report else None
    base_tps = base_report.get("tokens_per_s") if base_report else None
    rows.append((d, td, eff, pd.get("peak_gpu_bytes"), ps.get("peak_gpu_bytes") if d > 1 else None,
                 train_tps, train_tps / (d * base_tps) if (train_tps and base_tps and d > 1) else None,
                 report.get("last_loss") if report else None,
                 report.get("last_eval_loss") if report else None, worst))

def f(v, fmt):
    return "-" if v is None else format(v, fmt)

gib = 1 << 30
with open(os.path.join(out, "summary.md"), "w") as md:
    md.write(f"# Data parallel: {os.environ['MODEL']} {os.environ['PRECISION']}, "
             f"{os.environ['MB']} sequences per GPU, global batch {os.environ['GLOBAL']}\n\n")
    md.write("| GPUs | probe tokens/s | scaling efficiency | peak GPU per GPU (GiB) | sharded (GiB) "
             "| train tokens/s | train efficiency | last loss | eval loss | worst loss rel. diff vs 1 GPU |\n")
    md.write("|---|---|---|---|---|---|---|---|---|---|\n")
    for d, td, eff, g, gs, tt, te, ll, el, worst in rows:
        md.write(f"| {d} | {f(td, '.0f')} | {f(eff, '.3f')} | {f(g and g / gib, '.2f')} | "
                 f"{f(gs and gs / gib, '.2f')} | {f(tt, '.0f')} | {f(te, '.3f')} | {f(ll, '.4f')} | "
                 f"{f(el, '.4f')} | {f(worst, '.2e')} |\n")
    md.write("\nScaling efficiency = tokens/s on N GPUs / (N x tokens/s on one GPU), from probes of one "
             "micro-batch per GPU per step (the least compute per all-reduce); train efficiency is the "
             "same ratio over the whole training runs (accumulation GLOBAL/(MB x N)).\n\n## Checks\n\n")
    for verdict, text in checks:
        md.write(f"- {verdict}: {text}\n")
for verdict, text in checks:
    print(f"{verdict}: {text}")
raise SystemExit(1 if any(v == "FAIL" for v, _ in checks) else 0)
EOF
rc=$?
say "summary: $OUTDIR/summary.md (exit $rc)"
exit "$rc"
