#!/bin/bash
# Session 9-11 device calls (issue 4). Each call's outputs are tarred into $OUT/${TAG:-s9}_<CALL>.tgz (the
# device tool returns at most 8 files) and summarised on stdout.
#   CALL=ab: the new screen's kernel tests and the jit round trips compiled for the GPU, then the
#     A/B at T=4096, N=1M on the trained indexer (benchmarks/gpu_s7.sh's ablation mode): the
#     kernels exported in each AB_OLD directory (OLD_SPECS, OLD_RUNS) and this tree's
#     (DOSA_SPECS, RUNS), in the same call;
#   CALL=profile: benchmarks.profile_kernels runs (PROFILE_ARGS), then optionally the -m gpu tests;
#   CALL=final: gpu_s7.sh FINAL (XLA / dense / DoSA at SHAPES, exact_topk, the peak, then the
#     GPU kernel tests and the budget-class, record-buffer and jit round-trip tests).
# Usage (device tool): CALL=ab AB_OLD=ab_s8 DOSA_SPECS=... RUNS=... bash benchmarks/gpu_s9.sh
# Set DOSA_COMMIT=<sha> for CALL=final: the device copy's git metadata can be stale (session 10).
# TAG names the tarball (s9 by default; s10, s11 in sessions 10 and 11).
set -o pipefail
root=$OUT
W=$(mktemp -d)
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda
case "${CALL:-ab}" in
  ab)
    # AB_TESTS (pytest arguments) replaces the default selection; session 11 used
    # AB_TESTS='tests/test_pallas_kernels.py -k "refine_slices or predicted_list or overflow"'
    eval timeout ${SCREEN_TEST_TIMEOUT:-150} python -m pytest -o addopts="" -q \
      ${AB_TESTS:-tests/test_pallas_kernels.py::test_screen_matches_twin tests/test_screen_classes.py \
      tests/test_enclosure.py::test_rounding_round_trips_survive_jit} -p no:cacheprovider \
      > $W/tests_screen.txt 2>&1
    echo "screen tests exit $?"; tail -3 $W/tests_screen.txt
    mkdir -p $W/ab
    OUT=$W/ab NO_TESTS=1 bash benchmarks/gpu_s7.sh ;;
  profile)
    # PROFILE_ARGS: ';'-separated argument lists of benchmarks.profile_kernels (e.g. with
    # --kernels 40: each run's costliest kernels and idle time), each under PROFILE_TIMEOUT;
    # PROFILE_TESTS (pytest arguments) run first; then, with GPU_TESTS=1, the -m gpu kernel tests under TEST_TIMEOUT (session 12)
    if [ -n "${PROFILE_TESTS:-}" ]; then   # pytest arguments, compiled for the GPU first
      eval timeout ${SCREEN_TEST_TIMEOUT:-150} python -m pytest -o addopts="" -q $PROFILE_TESTS \
        -p no:cacheprovider > $W/tests_first.txt 2>&1
      echo "tests exit $?"; tail -3 $W/tests_first.txt
    fi
    IFS=';' read -ra PA <<< "${PROFILE_ARGS}"
    i=0
    for a in "${PA[@]}"; do
      i=$((i+1))
      eval timeout ${PROFILE_TIMEOUT:-240} python -m benchmarks.profile_kernels $a \
        > $W/profile_$i.jsonl 2> $W/profile_$i.err
      echo "profile $i exit $?: $a"; grep -v '"kernels@' $W/profile_$i.jsonl | cut -c1-400
      tail -2 $W/profile_$i.err
    done
    if [ -n "${GPU_TESTS:-}" ]; then
      timeout ${TEST_TIMEOUT:-280} python -m pytest -o addopts="" -q -m gpu -p no:cacheprovider \
        tests/test_pallas_kernels.py > $W/gpu_tests.txt 2>&1
      echo "pytest -m gpu exit $?"; tail -4 $W/gpu_tests.txt
    fi ;;
  final)
    mkdir -p $W/final
    OUT=$W/final FINAL=1 bash benchmarks/gpu_s7.sh ;;
esac
tar -czf $root/${TAG:-s9}_${CALL:-ab}.tgz -C $W .
ls -la $W/* | tail -20
