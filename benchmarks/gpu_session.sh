#!/bin/bash
# One device call: GPU tests, then the benchmark (sections/shapes from $1/$2), logs to $OUT.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
SECTIONS=${1:-peak,mma,select,sweep,shapes}
SHAPES=${2:-smoke_T256_N16k_H32,prefill_T4k_N128k_H32}
EXTRA=${3:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv 2>&1 | tee $OUT/log.txt
python -c "import jax; print(jax.__version__, jax.devices())" 2>&1 | tee -a $OUT/log.txt
JAX_PLATFORMS=cuda timeout ${TEST_TIMEOUT:-150} python -m pytest -o addopts="" -q -x -m gpu tests/test_pallas_kernels.py 2>&1 | tail -30 | tee -a $OUT/log.txt
timeout ${BENCH_TIMEOUT:-250} python -m benchmarks.run --sections $SECTIONS --shapes $SHAPES --out $OUT $EXTRA 2>&1 | tee -a $OUT/log.txt
if [ -n "$ENCLOSURE_PAIRS" ]; then
  timeout ${ENCLOSURE_TIMEOUT:-100} python -m proofs_numeric.enclosure --pairs $ENCLOSURE_PAIRS 2>&1 | tail -40 | tee $OUT/enclosure.txt
fi
