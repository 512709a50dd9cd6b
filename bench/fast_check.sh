#!/usr/bin/env bash
# One device call for the fast path: its GPU tests, the per-call overhead benchmark, then the
# rest of the GPU tests (regressions of the general path). Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/natten_cupy_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/natten_cupy_kernel_cache}
echo "== fast-path tests"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast.py -n 4 2>&1 | tail -25
echo "== overhead"
python3 bench/overhead.py --profile --out "$OUT/overhead.json" 2>&1 | tail -45
if [ "${1:-}" = "--all" ]; then
  echo "== all GPU tests"
  python3 -m pytest -q -m gpu -p no:cacheprovider tests -n 8 --ignore=tests/test_gpu_fast.py \
      --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
  echo "   pytest exit $?"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30; tail -n 2 "$OUT/tests.log"
fi
