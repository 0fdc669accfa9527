#!/bin/bash
# One device call for what session 1 could not verify on the H200 (jax 0.11.2):
#   1. the reference pipeline's CPU suite subset on the GPU backend (jax 0.11 API, bitwise DoSA == dense);
#   2. the >= 1e8-pair enclosure check (FP8 queries: the optimization_barrier fix in scorer.to_f32);
#   3. python -m dosa_jax on the default data.
# Usage (device tool): bash benchmarks/verify_gpu.sh    -- writes logs to $OUT.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
python -c "import jax; print(jax.__version__, jax.devices())" 2>&1 | tee $OUT/verify.txt
# -o addopts="": pyproject's -q plus this -q would hide pytest's summary line
timeout ${TEST_TIMEOUT:-420} python -m pytest -o addopts="" -q -x tests/test_api.py tests/test_exactness.py \
  tests/test_fp8_guards.py tests/test_adversarial.py 2>&1 | tail -15 | tee -a $OUT/verify.txt
timeout ${ENCLOSURE_TIMEOUT:-300} python -m proofs_numeric.enclosure --pairs ${ENCLOSURE_PAIRS:-100000000} \
  2>&1 | tail -30 | tee $OUT/enclosure.txt
timeout 120 python -m dosa_jax 2>&1 | tail -10 | tee -a $OUT/verify.txt
