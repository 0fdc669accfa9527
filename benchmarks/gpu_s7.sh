#!/bin/bash
# Session 7, one device call (issue 4), tables and logs to $OUT. Times are device times
# (CUPTI activity spans, benchmarks/devtime.py) with the wall times of the same calls beside.
#   default: [GPU kernel tests (-m gpu) unless NO_TESTS] then exact_topk cut into stages
#     plus the peak (SELECT=1), then the ablation at T=4096, N=1M on the trained indexer
#     (benchmarks.profile_kernels --stages): DOSA_SPECS, restricted to RUNS;
#   AB_OLD="<dir> ..." (with the default mode): first the same ablation run from inside each
#     <dir> (an export of another version's pallas_kernels/ and benchmarks/, sent with the
#     device tool's carry), specs OLD_SPECS, runs OLD_RUNS -> ablation_old_<dir>.jsonl: A/B
#     in one call;
#   FINAL=1: XLA / dense / DoSA at 128K and 1M (SHAPES), exact_topk and the peak; then (unless
#     NO_TESTS) the GPU kernel tests, and the budget-class, record-buffer and jit round-trip
#     tests compiled for the GPU (ONLY_TESTS=1: those tests alone, no benchmark).
# Usage (device tool): bash benchmarks/gpu_s7.sh
set -o pipefail
mkdir -p $OUT
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv 2>&1 | tee $OUT/log.txt
if [ -z "${FINAL:-}" ]; then
  if [ -z "${NO_TESTS:-}" ]; then
    timeout ${TEST_TIMEOUT:-170} python -m pytest -o addopts="" -q -x -m gpu -k "${TESTS_K:-}" \
      tests/ -p no:cacheprovider > $OUT/tests.txt 2>&1
    echo "pytest exit $?" | tee -a $OUT/log.txt; tail -3 $OUT/tests.txt
  fi
  if [ -n "${SELECT:-}" ]; then
    timeout ${SELECT_TIMEOUT:-150} python -m benchmarks.run --sections select,peak \
      --select-variants "${SELECT_VARIANTS:-}" --out $OUT/select > $OUT/select_log.txt 2>&1
    echo "select exit $?" | tee -a $OUT/log.txt; grep -v "^\s*$" $OUT/select_log.txt | tail -8
  fi
  for d in ${AB_OLD:-}; do   # each: ablation_old_<dir>.jsonl
    # run from inside the export: python puts the working directory ahead of PYTHONPATH
    (cd $d && PYTHONPATH=.:$OLDPWD timeout ${ABL_TIMEOUT:-380} python -m benchmarks.profile_kernels \
      --T ${T:-4096} --N ${N:-1048576} --tiles "" --stages --iters ${ITERS:-5} \
      --runs "${OLD_RUNS:-}" --dosa "${OLD_SPECS:-/8192}" > $OUT/ablation_old_$d.jsonl \
      2> $OUT/ablation_old_${d}_err.txt)
    echo "ablation $d exit $?" | tee -a $OUT/log.txt; cat $OUT/ablation_old_$d.jsonl
    tail -3 $OUT/ablation_old_${d}_err.txt
  done
  if [ -n "${DOSA_SPECS:-}${DENSE_TILES:-}" ]; then
    timeout ${ABL_TIMEOUT:-380} python -m benchmarks.profile_kernels --T ${T:-4096} \
      --N ${N:-1048576} --tiles "${NR_TILES:-}" --stages --iters ${ITERS:-5} --runs "${RUNS:-}" \
      --dosa "${DOSA_SPECS:-}" --dense-tiles "${DENSE_TILES:-}" > $OUT/ablation.jsonl \
      2> $OUT/ablation_err.txt
    echo "ablation exit $?" | tee -a $OUT/log.txt; cat $OUT/ablation.jsonl; tail -3 $OUT/ablation_err.txt
  fi
else
  if [ -z "${ONLY_TESTS:-}" ]; then
    timeout ${BENCH_TIMEOUT:-540} python -m benchmarks.run --data ${DATA:-trained:code:2} \
      --sections shapes,select,peak --iters ${ITERS:-10} \
      --shapes "${SHAPES:-prefill_T16k_N128k_H32@/8192,prefill_T16k_N1024k_H32@/8192}" \
      --select-variants "" --out $OUT > $OUT/bench_log.txt 2>&1
    echo "benchmark exit $?" | tee -a $OUT/log.txt
    grep -v "^\s*$" $OUT/bench_log.txt | tail -30
  fi
  if [ -z "${NO_TESTS:-}" ]; then   # after the figures: the GPU kernel tests, then the class tests
    timeout ${TEST_TIMEOUT:-170} python -m pytest -o addopts="" -q -m gpu -k "${TESTS_K:-}" \
      tests/test_pallas_kernels.py tests/test_screen_classes.py -p no:cacheprovider \
      > $OUT/tests.txt 2>&1
    echo "pytest -m gpu exit $?" | tee -a $OUT/log.txt; tail -3 $OUT/tests.txt
    # compiled for the GPU and under jax.jit: the budget classes, the record buffers, the
    # rounding round trips XLA's GPU compiler may drop (session 8), the automatic budget and its
    # allowance estimates (session 13); CLASS_TESTS_MORE: more pytest arguments
    timeout ${CLASS_TEST_TIMEOUT:-180} python -m pytest -o addopts="" -q \
      tests/test_screen_classes.py tests/test_records.py tests/test_budget.py \
      tests/test_allowance_estimate.py tests/test_enclosure.py::test_rounding_round_trips_survive_jit \
      ${CLASS_TESTS_MORE:-} -p no:cacheprovider \
      > $OUT/tests_classes.txt 2>&1
    echo "pytest classes exit $?" | tee -a $OUT/log.txt; tail -3 $OUT/tests_classes.txt
  fi
fi
