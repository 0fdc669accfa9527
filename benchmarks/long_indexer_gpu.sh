#!/bin/bash
# One device call for issue 5's long-context step (about 9 minutes on the H200):
#   1. fine-tune the committed indexers on 32K-token crops (preset h200-long), export int8 weights;
#   2. coverage of the fine-tuned indexer at 128K;
#   3. pruning on the fine-tuned indexer's 128K dumps, every layer and domain (reference backend).
# Usage (device tool): bash benchmarks/long_indexer_gpu.sh   -- everything lands in $OUT.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
W=/tmp/w_long
timeout ${TRAIN_TIMEOUT:-300} python -m dosa_jax.lm.train --preset h200-long \
  --weights dosa_jax/data/lm_weights.npz --indexer-init --workdir $W \
  --indexer-seconds ${INDEXER_SECONDS:-230} --eval-crops 4 \
  --export $OUT/lm_weights.npz --metrics $OUT/long_metrics.json 2>&1 | tee $OUT/long_train_log.txt
[ -f $OUT/lm_weights.npz ] && cp $OUT/lm_weights.npz dosa_jax/data/lm_weights.npz
timeout ${COVERAGE_TIMEOUT:-70} python -m dosa_jax.lm.long_context_coverage --lengths 131072 \
  --json $OUT/long_coverage.json 2>&1 | tail -30 | tee $OUT/long_coverage.txt
timeout ${PRUNING_TIMEOUT:-200} python -m benchmarks.pruning_trained --length ${LENGTH:-131072} \
  --queries ${QUERIES:-256} --out $OUT/pruning_long.md 2>&1 | tee $OUT/pruning_log.txt
