#!/usr/bin/env bash
# The GPU runner: on a machine with a GPU (and the packages preinstalled, no network), run
# the GPU test suite and then the benchmark suite in one go. Full logs and JSON go to $OUT;
# a short summary table is printed last.
#   bash bench/gpu_run.sh [--quick] [--tests-only|--bench-only] [--probe] [extra pytest args...]
# --probe also runs bench/probes/tiled_probe.py (per-kernel times and bandwidth of the unfused
# chain, tiled next to naive) after the tests.
# --sweep runs bench/sweep.py (seeded random configurations per CUDA backend and dtype against
# the float64 reference; $SWEEP_CASES a stream, subset $SWEEP_SUBSET, $SWEEP_BUDGET_S) and
# --sanitize bench/sanitize.py (compute-sanitizer memcheck, racecheck, initcheck over every
# kernel family, $SANITIZE_BUDGET_S), both last; with --tests-only or --bench-only they run
# after that part only. --general runs bench/models.py on the G set (layers of other models,
# as users call them, next to FlexAttention; $GENERAL_BUDGET_S) into general.json, after those;
# --perf-sweep bench/perf_sweep.py (seeded random model-shaped problems next to FlexAttention,
# seed $PERF_SEED, dtypes $PERF_DTYPES, head dims $PERF_HEAD_DIMS if set, $PERF_BUDGET_S) into
# perf_sweep.json, last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/natten_cupy_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/natten_cupy_kernel_cache}
PY=${PYTHON:-python3}

mode=all; quick=""; probe=""; sweep=""; sanitize=""; general=""; perf=""; pytest_extra=()
for a in "$@"; do
  case "$a" in
    --quick) quick=1 ;;
    --tests-only) mode=tests ;;
    --bench-only) mode=bench ;;
    --probe) probe=1 ;;
    --sweep) sweep=1 ;;
    --sanitize) sanitize=1 ;;
    --general) general=1 ;;
    --perf-sweep) perf=1 ;;
    *) pytest_extra+=("$a") ;;
  esac
done

"$PY" - <<'PY' | tee "$OUT/device.txt"
import cupy, torch
p = cupy.cuda.runtime.getDeviceProperties(0)
print(f"device: {p['name'].decode()}  sm_{p['major']}{p['minor']}  cupy {cupy.__version__}  torch {torch.__version__}")
PY

status=0
if [ "$mode" != bench ]; then
  echo "== GPU tests"
  t0=$(date +%s)
  NATTEN_CUPY_GPU_QUICK=${quick} "$PY" -m pytest -q -m gpu -p no:cacheprovider tests \
      -n ${NATTEN_TEST_WORKERS:-8} --continue-on-collection-errors --junitxml="$OUT/tests.xml" "${pytest_extra[@]}" > "$OUT/tests.log" 2>&1
  status=$?
  echo "   pytest exit $status in $(( $(date +%s) - t0 )) s"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -40
  tail -n 3 "$OUT/tests.log"
  [ -f "$OUT/tests.xml" ] && "$PY" bench/junit_summary.py "$OUT/tests.xml" "$OUT/gpu_tests.json" \
      --commit "${NATTEN_CUPY_COMMIT:-}" --device "$(cat "$OUT/device.txt")"
fi
if [ -n "$probe" ]; then
  echo "== unfused-chain probe"
  t0=$(date +%s)
  "$PY" bench/probes/tiled_probe.py --out "$OUT/tiled_probe.json" --workloads ${PROBE_WORKLOADS:-W2,W3} \
      --dtypes ${PROBE_DTYPES:-fp16,bf16,fp32,tf32} --extra ${PROBE_EXTRA:-W2b:fp16,W2b:fp32,W1:fp16} \
      > "$OUT/tiled_probe.log" 2>&1 \
      || { echo "   probe failed:"; tail -n 25 "$OUT/tiled_probe.log"; status=1; }
  grep -E "^(==|  [a-z])" "$OUT/tiled_probe.log"
  echo "   probe done in $(( $(date +%s) - t0 )) s"
fi
if [ "$mode" != tests ]; then
  echo "== benchmarks"
  t0=$(date +%s)
  # The targets' groups, most important first; naive and unfused chains on W2 and W3 only.
  groups=${BENCH_GROUPS:-W2:fp16,W3:fp16,W2:fp32,W2:tf32,W2:bf16,W3:fp32,W1:fp16,W3b:fp16,W2b:fp16,SA:fp16}
  if [ -n "$quick" ]; then budget=150; else budget=${BENCH_BUDGET_S:-300}; fi
  "$PY" bench/suite.py --out "$OUT/bench.json" --groups "$groups" --others-on W2,W3 \
      --budget-s "$budget" > "$OUT/bench.log" 2>&1 \
      || { echo "   bench failed:"; tail -n 25 "$OUT/bench.log"; status=1; }
  echo "   bench done in $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  timeout 150 "$PY" bench/cold_start.py --out "$OUT/cold_start.json" > "$OUT/cold_start.log" 2>&1 \
      || echo "   cold start failed or timed out (see cold_start.log)"
  echo "   cold start done in $(( $(date +%s) - t0 )) s"; tail -n 6 "$OUT/cold_start.log"
  [ -f "$OUT/bench.json" ] && "$PY" bench/report.py "$OUT/bench.json" --summary
fi
if [ -n "$sweep" ]; then
  echo "== random sweep"
  t0=$(date +%s)
  cases=${SWEEP_CASES:-1000}
  "$PY" bench/sweep.py --seed 13 --cases "$cases" --first $(( ${SWEEP_SUBSET:-0} * cases )) \
      --time-budget-s ${SWEEP_BUDGET_S:-300} --out "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1 \
      || { echo "   sweep found failures (or could not run):"; status=1; }
  grep -vE "^(FAILED|       \{)" "$OUT/sweep.log" | tail -n 16; grep -E "^FAILED" "$OUT/sweep.log" | head -10
  echo "   sweep done in $(( $(date +%s) - t0 )) s (subset ${SWEEP_SUBSET:-0}, seed 13)"
fi
if [ -n "$sanitize" ]; then
  echo "== compute-sanitizer"
  t0=$(date +%s)
  "$PY" bench/sanitize.py --out-dir "$OUT/sanitize" --time-budget-s ${SANITIZE_BUDGET_S:-420} \
      > "$OUT/sanitize.log" 2>&1 || { echo "   sanitizers found errors (or could not run):"; status=1; }
  cat "$OUT/sanitize.log"
  echo "   sanitizers done in $(( $(date +%s) - t0 )) s"
fi
if [ -n "$general" ]; then
  echo "== the G set (layers of other models) as users call them"
  t0=$(date +%s)
  groups=$("$PY" -c "import sys; sys.path.insert(0, 'bench'); import workloads as w; print(','.join(f'{a}:{b}' for a, b in w.GENERAL_GROUPS))")
  "$PY" bench/models.py --groups "$groups" --no-compiled --budget-s ${GENERAL_BUDGET_S:-240} \
      --out "$OUT/general.json" > "$OUT/general.log" 2>&1 \
      || { echo "   G set failed:"; tail -n 25 "$OUT/general.log"; status=1; }
  grep -E "^\| G" "$OUT/general.log"
  echo "   G set done in $(( $(date +%s) - t0 )) s"
fi
if [ -n "$perf" ]; then
  echo "== random model-shaped problems next to FlexAttention (seed ${PERF_SEED:-1})"
  t0=$(date +%s)
  "$PY" bench/perf_sweep.py --seed ${PERF_SEED:-1} --count 60 --budget-s ${PERF_BUDGET_S:-240} \
      --dtypes ${PERF_DTYPES:-bf16,fp16} ${PERF_HEAD_DIMS:+--head-dims $PERF_HEAD_DIMS} \
      --out "$OUT/perf_sweep.json" > "$OUT/perf_sweep.log" 2>&1 \
      || { echo "   perf sweep failed:"; tail -n 25 "$OUT/perf_sweep.log"; status=1; }
  grep -E "problems, |LOSS" "$OUT/perf_sweep.log"
  echo "   perf sweep done in $(( $(date +%s) - t0 )) s"
fi
exit $status
