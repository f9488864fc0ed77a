# lib.sh — what the scripts in benches/gpu/ share. Sourced, never run:
#
#   # shellcheck source-path=SCRIPTDIR source=lib.sh
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# Source it first, before the script changes directory: it finds the repository from its own
# path. It sets no shell options and changes no directory; it sets:
#   SCRIPT     the script's file name, the prefix of its messages
#   BENCH_DIR  benches/gpu/, absolute
#   ROOT       the repository root, absolute
#   GPU_DIR    $GPU_DIR, default .gpu (relative to ROOT): the CUDA build and its libcudart
#   PYTHON     $PYTHON, default python3
#   START      when the script sourced this file, in seconds since the epoch (say counts from it)
#   TORCH_ENV  a command prefix that runs PyTorch with the library path the script started with
#              (its wheels pin their own CUDA runtime, which the libcudart bundled for our binary
#              must not shadow): `"${TORCH_ENV[@]}" "$PYTHON" ...`
# and defines the functions below.
# shellcheck shell=bash
# shellcheck disable=SC2034  # the variables are for the scripts that source this file

SCRIPT="$(basename "$0")"
BENCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$BENCH_DIR/../.." && pwd)"
GPU_DIR="${GPU_DIR:-.gpu}"
PYTHON="${PYTHON:-python3}"
if [[ -n "${LD_LIBRARY_PATH+x}" ]]; then
  TORCH_ENV=(env "LD_LIBRARY_PATH=$LD_LIBRARY_PATH")
else
  TORCH_ENV=(env -u LD_LIBRARY_PATH)
fi
START="$(date +%s)"

# say MESSAGE...: one progress line on stderr, the script's name and its seconds so far first.
say() { echo "$SCRIPT [$(( $(date +%s) - START ))s] $*" >&2; }

# ---- arguments and folders ---------------------------------------------------------------

# usage: print the script's header comment (its second line up to the first line that is not
# a comment) without the comment marks, and exit 2.
usage() {
  awk 'NR == 1 { next } !/^#/ { exit } { sub(/^# ?/, ""); print }' "$0"
  exit 2
}

# wants STAGE: whether the script's $STAGES (a space-separated list) names STAGE.
wants() { [[ " $STAGES " == *" $1 "* ]]; }

# help_asked ARG...: whether the first argument is -h or --help.
help_asked() { [[ "${1:-}" == -h || "${1:-}" == --help ]]; }

# open_outdir DIR: create DIR (relative to where the script was started), set OUTDIR to its
# absolute path, then work from the repository root, so that relative paths (.gpu/, benches/)
# mean the same whatever directory the script was started from.
open_outdir() {
  mkdir -p "$1"
  OUTDIR="$(cd "$1" && pwd)"
  cd "$ROOT" || exit
}

# need_bin HINT: exit 2 with a message unless $BIN is an executable file; HINT says how to get one.
need_bin() {
  [[ -x "$BIN" ]] || { echo "$SCRIPT: $BIN not found or not executable ($1)" >&2; exit 2; }
}

# find_ncu: the first of $NCU, ncu on PATH and Nsight Compute's usual folders that runs.
find_ncu() {
  local cand
  for cand in ${NCU:+"$NCU"} ncu /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu; do
    if command -v "$cand" > /dev/null 2>&1; then command -v "$cand"; return 0; fi
  done
}

# ---- libraries ---------------------------------------------------------------------------
# The binary bundles libcudart in its folder; cuBLAS, cuRAND etc. come from the machine (usually
# the nvidia-* wheels that PyTorch installed). gpu-env.sh (../shared/tools/gpu-env.sh, copied
# next to the binary) finds them; without it the scripts fall back to a path of their own.

# find_gpu_env DIR: set GPU_ENV to $GPU_ENV when set, else to the first of DIR/gpu-env.sh and
# ../shared/tools/gpu-env.sh (from the repository root) that exists, else to "".
find_gpu_env() {
  GPU_ENV="${GPU_ENV:-}"
  [[ -n "$GPU_ENV" ]] && return 0
  local cand
  for cand in "$1/gpu-env.sh" ../shared/tools/gpu-env.sh; do
    [[ -f "$cand" ]] && { GPU_ENV="$cand"; return 0; }
  done
  return 0
}

# source_gpu_env FILE [DIR...]: source gpu-env.sh with DIRs searched first. It is written for
# interactive shells (unset variables, grep -q in pipes): strict mode is off while it runs, and
# the caller's shell options are restored afterwards.
source_gpu_env() {
  local file="$1" flags="$-" pipefail=0
  shift
  if shopt -qo pipefail; then pipefail=1; fi
  set +euo pipefail
  # shellcheck disable=SC1090
  source "$file" "$@"
  if [[ "$flags" == *e* ]]; then set -e; fi
  if [[ "$flags" == *u* ]]; then set -u; fi
  if (( pipefail )); then set -o pipefail; fi
  return 0
}

# wheel_lib_dirs: the nvidia/*/lib folders of $PYTHON's installed wheels, one per line.
wheel_lib_dirs() {
  "$PYTHON" - <<'EOF' 2>/dev/null || true
import glob, os, site, sys
roots = set(site.getsitepackages() + [site.getusersitepackages()] + sys.path)
for r in sorted(roots):
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        print(d)
EOF
}

# gpu_libraries DIR FALLBACK [show]: make the libraries of the binary in DIR loadable. Sources
# gpu-env.sh (find_gpu_env DIR) with DIR's absolute path; without one, FALLBACK puts on the front
# of LD_LIBRARY_PATH
#   wheels  DIR and the folders of wheel_lib_dirs
#   dir     DIR alone
# and with `show` the new LD_LIBRARY_PATH is printed on stderr.
gpu_libraries() {
  local dir fallback="$2" show="${3:-}" dirs d
  dir="$(cd "$1" && pwd)"
  find_gpu_env "$1"
  if [[ -n "$GPU_ENV" ]]; then
    source_gpu_env "$GPU_ENV" "$dir"
    return 0
  fi
  dirs="$dir"
  if [[ "$fallback" == wheels ]]; then
    while IFS= read -r d; do
      [[ -n "$d" ]] && dirs="$dirs:$d"
    done < <(wheel_lib_dirs)
  fi
  export LD_LIBRARY_PATH="$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [[ "$show" != show ]] || echo "$SCRIPT: LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >&2
}

# ---- records -----------------------------------------------------------------------------

# utc_now: the date and time, UTC, as 2026-12-02T12:40:04Z.
utc_now() { date -u +%Y-%m-%dT%H:%M:%SZ; }

# commit_id [--short]: the commit checked out in the repository, or "unknown".
commit_id() { git rev-parse "$@" HEAD 2>/dev/null || echo unknown; }

# record_header: the first lines of an env.txt: date, host and (short) commit.
record_header() {
  echo "date: $(utc_now)"
  echo "host: $(uname -srm)"
  echo "commit: $(commit_id --short)"
}

# gpu_line [NONE]: name, driver and memory of the first GPU in one CSV line; NONE (default empty)
# when nvidia-smi cannot be run.
gpu_line() {
  (nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
    || echo "${1:-}") | head -n 1
}

# ---- runs --------------------------------------------------------------------------------

# bounded SECONDS CMD...: CMD under `timeout --kill-after=10 SECONDS`, its exit status returned.
# `timeout` puts CMD in a process group of its own, which a signal to the script's group (an
# outer `timeout`, Ctrl-C) does not reach, and bash runs a trap only once a command in the
# foreground has ended. So CMD runs in the background and is waited for, with traps that pass a
# TERM, INT or HUP of the script on to it (`timeout` passes it on to CMD's group) and end the
# script; the script's own traps are restored afterwards. CMD keeps the script's standard input.
BOUNDED_PID=""
bounded() {
  local seconds="$1" rc=0 traps
  shift
  traps="$(trap -p TERM INT HUP)"
  timeout --kill-after=10 "$seconds" "$@" <&0 &
  BOUNDED_PID=$!
  trap 'stop_bounded 143' TERM
  trap 'stop_bounded 130' INT
  trap 'stop_bounded 129' HUP
  wait "$BOUNDED_PID" || rc=$?
  trap - TERM INT HUP
  eval "$traps"
  BOUNDED_PID=""
  return "$rc"
}

# stop_bounded CODE: TERM to the command `bounded` waits for, then exit with CODE. TERM whatever
# stopped the script: a command started in the background of a script ignores INT.
stop_bounded() {
  kill -s TERM "$BOUNDED_PID" 2> /dev/null
  wait "$BOUNDED_PID" 2> /dev/null
  exit "$1"
}

# warm_up SECONDS LOG DEVICE PRECISION [PROBE_ARG...]: one untimed tiny probe of $BIN, its stderr
# appended to LOG, its status returned. The binary carries portable PTX that the driver compiles
# at first load (~15-20 s) and caches in ~/.nv/ComputeCache; a warm-up keeps that cost out of
# the first measurement and out of its timeout.
warm_up() {
  local seconds="$1" log="$2" device="$3" precision="$4"
  shift 4
  bounded "$seconds" "$BIN" probe --model tiny --precision "$precision" --micro-batch 2 \
    --warmup 1 --steps 1 --device "$device" --json "$@" > /dev/null 2>> "$log"
}

# timed_json SECONDS OUT LOG CMD...: run CMD under `bounded SECONDS` (see above), its stdout
# into OUT and its stderr appended to LOG. Sets RC to its exit status and JSON_LINE to the last
# line of OUT that starts with `{` (empty when it printed none: a crash, a timeout, a loader
# error). Always returns 0.
timed_json() {
  local seconds="$1" out="$2" log="$3"
  shift 3
  RC=0
  bounded "$seconds" "$@" > "$out" 2>> "$log" || RC=$?
  JSON_LINE="$(grep '^{' "$out" | tail -n 1 || true)"
}

# no_json_outcome RC: the outcome recorded for a run that printed no JSON: timeout when `timeout`
# ended it (124, or 137 when it had to kill), error otherwise.
no_json_outcome() {
  if [[ "$1" -eq 124 || "$1" -eq 137 ]]; then echo timeout; else echo error; fi
}

# outcome_field LINE: the `"outcome": "..."` fields of a JSON line as written, empty when none.
outcome_field() { grep -o '"outcome": *"[a-z_]*"' <<< "$1" || true; }
