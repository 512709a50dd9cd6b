#!/usr/bin/env bash
# One device call for what users see per call: the fast path's GPU tests, the per-call
# overhead benchmark, with --models the model-shaped workloads next to FlexAttention, with
# --all the rest of the GPU tests. Results under $OUT.
#   bash bench/fast_check.sh [--models] [--all]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/natten_cupy_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/natten_cupy_kernel_cache}
export NATTEN_CUPY_COMMIT=${NATTEN_CUPY_COMMIT:-unknown}   # pass the commit: the device copy has no current .git
models=""; all=""
for a in "$@"; do case "$a" in --models) models=1 ;; --all) all=1 ;; esac; done
echo "== fast-path tests"
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_fast.py -n 4 2>&1 | grep -E "passed|failed|Error|^FAILED" | tail -25
echo "== overhead"
python3 bench/overhead.py --out "$OUT/overhead.json" 2>&1 | tail -16
if [ -n "$models" ]; then
  echo "== model-shaped workloads"
  python3 bench/models.py --out "$OUT/models.json" --budget-s "${MODELS_BUDGET_S:-330}" \
      > "$OUT/models.log" 2>&1 || { echo "   models failed:"; tail -20 "$OUT/models.log"; }
  tail -16 "$OUT/models.log"
fi
if [ -n "$all" ]; then
  echo "== all GPU tests"
  python3 -m pytest -q -m gpu -p no:cacheprovider tests -n 8 --ignore=tests/gpu/test_gpu_fast.py \
      --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
  echo "   pytest exit $?"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30; tail -n 2 "$OUT/tests.log"
fi
