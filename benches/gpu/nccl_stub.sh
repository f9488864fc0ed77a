#!/usr/bin/env bash
# nccl_stub.sh — a link-time stand-in for libnccl, so that `--features nccl` builds link on a
# machine without NCCL (the build machine); the GPU machine loads the real libnccl.so.2 (the
# one PyTorch's nvidia-nccl wheel brings, or the system's).
#
#   eval "$(bash ../shared/tools/cuda-build.sh --env)"
#   eval "$(bash benches/gpu/nccl_stub.sh --env)"
#   CARGO_FEATURES=nccl bash ../shared/tools/cuda-build.sh --out .gpu
#
# It compiles one empty function per `pub unsafe fn nccl*` of cudarc's NCCL bindings into
# `libnccl.so` with the SONAME `libnccl.so.2`, the library the binary will then need, under
# target/nccl-stub/ (override with NCCL_STUB_DIR). With --env it prints the LIBRARY_PATH export
# (the shared build script keeps an existing LIBRARY_PATH).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
OUT="${NCCL_STUB_DIR:-$ROOT/target/nccl-stub}"

cargo fetch --quiet
CUDARC_DIR=$(cargo metadata --format-version 1 --features nccl | "$PYTHON" -c '
import json,sys,os
m=json.load(sys.stdin)
c=[p for p in m["packages"] if p["name"]=="cudarc"]
print(os.path.dirname(c[0]["manifest_path"]) if c else "")')
SRC="$CUDARC_DIR/src/nccl/sys/mod.rs"
[[ -f "$SRC" ]] || { echo "nccl_stub.sh: cudarc's NCCL bindings not found ($SRC)" >&2; exit 1; }
STAMP="$OUT/.from-$(basename "$CUDARC_DIR")"
if [[ ! -f "$STAMP" ]]; then
  rm -rf "$OUT"; mkdir -p "$OUT"
  grep -oE '^pub unsafe fn nccl[A-Za-z0-9_]+\(' "$SRC" \
    | sed -E 's/^pub unsafe fn ([A-Za-z0-9_]+)\(/void \1(void){}/' | sort -u > "$OUT/nccl.c"
  cc -shared -fPIC -o "$OUT/libnccl.so" -Wl,-soname,libnccl.so.2 "$OUT/nccl.c"
  rm -f "$OUT/nccl.c"
  touch "$STAMP"
  echo ">> NCCL link stub: $OUT/libnccl.so ($(nm -D --defined-only "$OUT/libnccl.so" | grep -c ' T nccl') functions)" >&2
fi
if [[ "${1:-}" == "--env" ]]; then
  printf 'export LIBRARY_PATH=%q\n' "$OUT${LIBRARY_PATH:+:$LIBRARY_PATH}"
fi
