#!/bin/bash
# Session 5, one device call (issue 4), tables and logs to $OUT:
#   1. the GPU kernel tests (-m gpu);
#   2. DoSA configuration sweeps (seeds per query / anchor stride, each checked bitwise against
#      dense) on the trained indexer at T=16K, N=1M and N=128K;
#   3. with FINAL=1 instead: XLA / dense / DoSA at 128K and 1M (SHAPES), exact_topk, the peak.
# Usage (device tool): DOSA_COMMIT=<sha> bash benchmarks/gpu_s5.sh
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv 2>&1 | tee $OUT/log.txt
if [ -z "${FINAL:-}" ]; then
  timeout ${TEST_TIMEOUT:-120} python -m pytest -o addopts="" -q -x -m gpu tests/test_pallas_kernels.py \
    -p no:cacheprovider > $OUT/tests.txt 2>&1; echo "pytest exit $?" | tee -a $OUT/log.txt
  tail -3 $OUT/tests.txt
  # the seed kernel, witness lists and radix search compiled for the GPU (not interpret mode)
  timeout ${TEST2_TIMEOUT:-120} python -m pytest -o addopts="" -q -x tests/test_pallas_kernels.py \
    -k "seed_scores or witness or kth_largest" -p no:cacheprovider > $OUT/tests_seeds.txt 2>&1
  echo "pytest seeds exit $?" | tee -a $OUT/log.txt; tail -3 $OUT/tests_seeds.txt
  for N in ${SWEEP_NS:-1024k 128k}; do
    mkdir -p $OUT/sweep_$N
    timeout ${SWEEP_TIMEOUT:-200} python -m benchmarks.run --data ${DATA:-trained:code:2} \
      --sections dosa_sweep --sweep-shape prefill_T16k_N${N}_H32 --iters ${ITERS:-5} \
      --dosa-sweep "${DOSA_SWEEP:-/8192,/8192/64,/8192/16,/16384/64}" --out $OUT/sweep_$N \
      > $OUT/sweep_$N/log.txt 2>&1; echo "sweep $N exit $?" | tee -a $OUT/log.txt
    grep dosa_sweep $OUT/sweep_$N/log.txt
  done
else   # the shapes section is session 6's script's (with session 5's anchored default)
  SHAPES="${SHAPES:-prefill_T16k_N128k_H32@/8192/64,prefill_T16k_N1024k_H32@/8192/64}" \
    bash "$(dirname "$0")/gpu_s6.sh"
fi
