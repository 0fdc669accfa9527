#!/bin/bash
# Session 11 device calls (issue 4); outputs tarred into $OUT/${TAG:-s11}_<CALL>.tgz.
#   CALL=ab: the refinement, overflow and DoSA == dense tests compiled for the GPU, then the
#     A/B at T=4096, N=1M on the trained indexer (benchmarks.profile_kernels --stages, specs
#     DOSA_SPECS restricted to RUNS);
#   CALL=final: benchmarks/gpu_s7.sh FINAL (XLA / dense / DoSA at SHAPES, exact_topk, the peak,
#     then the GPU kernel tests unless NO_TESTS; ONLY_TESTS=1: the tests alone).
# Pass DOSA_COMMIT=<sha>: the device copy's git metadata can be stale (session 10).
set -o pipefail
root=$OUT
W=$(mktemp -d)
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda
case "${CALL:-ab}" in
  ab)
    timeout ${AB_TEST_TIMEOUT:-150} python -m pytest -o addopts="" -q \
      tests/test_pallas_kernels.py -k "${AB_TESTS_K:-refine_slices or predicted_list or overflow or bitwise}" \
      -p no:cacheprovider > $W/tests_ab.txt 2>&1
    echo "ab tests exit $?"; tail -3 $W/tests_ab.txt
    mkdir -p $W/ab
    OUT=$W/ab NO_TESTS=1 bash benchmarks/gpu_s7.sh ;;
  final)
    mkdir -p $W/final
    OUT=$W/final FINAL=1 bash benchmarks/gpu_s7.sh ;;
esac
tar -czf $root/${TAG:-s11}_${CALL:-ab}.tgz -C $W .
ls -la $W/* | tail -20
