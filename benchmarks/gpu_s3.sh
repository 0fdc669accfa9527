#!/bin/bash
# One device call (session 3, issue 4), tables and logs to $OUT:
#   1. the benchmark on the trained indexer's dumps: a DoSA configuration sweep at 1M (scoring
#      tiles, screening kernel, seed count; each checked bitwise against dense), then XLA / dense /
#      DoSA at 128K and 1M with the sweep's fastest configuration, exact_topk variants, the peak;
#   2. the GPU kernel tests (both MMA layouts), with what time is left.
# Usage (device tool): DOSA_COMMIT=<sha> bash benchmarks/gpu_s3.sh
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv 2>&1 | tee $OUT/log.txt
timeout ${BENCH_TIMEOUT:-450} python -m benchmarks.run --data ${DATA:-trained:code:2} \
  --sections ${SECTIONS:-dosa_sweep,shapes,select,peak} --sweep-shape ${SWEEP_SHAPE:-prefill_T16k_N1024k_H32} \
  --dosa-sweep "${DOSA_SWEEP:-kh:128:4:3,kh:128:4:3:kh:4:4,kh:128:4:3:kh:8:4,kh:128:4:3:kh:8:4/8192,kh:128:4:3:kh:8:4/4096}" \
  --iters ${ITERS:-5} --shapes "${SHAPES:-prefill_T16k_N128k_H32@dbest,prefill_T16k_N1024k_H32@dbest}" \
  --select-variants "${SELECT_VARIANTS:-512:0,1024:2,2048:0}" --out $OUT ${EXTRA:-} \
  > $OUT/bench_log.txt 2>&1; echo "benchmark exit $?" | tee -a $OUT/log.txt
grep -v "^\s*$" $OUT/bench_log.txt | tail -40
timeout ${TEST_TIMEOUT:-100} python -m pytest -o addopts="" -q -x -m gpu tests/test_pallas_kernels.py \
  -p no:cacheprovider > $OUT/tests.txt 2>&1; echo "pytest exit $?" | tee -a $OUT/log.txt
tail -5 $OUT/tests.txt
