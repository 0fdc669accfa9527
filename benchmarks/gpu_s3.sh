#!/bin/bash
# One device call (session 3, issue 4): GPU kernel tests (both MMA layouts), then the dense tile
# sweep at 128K and DoSA / dense / XLA on the trained indexer's dumps with the default and the
# sweep's best tiles. Usage (device tool): bash benchmarks/gpu_s3.sh   -- logs and tables to $OUT.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv 2>&1 | tee $OUT/log.txt
JAX_PLATFORMS=cuda timeout ${TEST_TIMEOUT:-150} python -m pytest -q -x -m gpu tests/test_pallas_kernels.py \
  -p no:cacheprovider 2>&1 | tail -8 | tee -a $OUT/log.txt
JAX_PLATFORMS=cuda timeout ${BENCH_TIMEOUT:-400} python -m benchmarks.run --data ${DATA:-trained:code:2} \
  --sections ${SECTIONS:-sweep,shapes} --sweep-shape prefill_T16k_N128k_H32 --iters ${ITERS:-5} \
  --shapes "${SHAPES:-prefill_T16k_N128k_H32,prefill_T16k_N1024k_H32@best}" --tiles "${TILES:-,best}" \
  --stages-max-n ${STAGES_MAX_N:-131072} --out $OUT ${EXTRA:-} 2>&1 | grep -v "^\s*$" | tail -60 | tee -a $OUT/log.txt
