"""A small byte-level LM with DeepSeek-V3.2-style DSA indexers, for realistic indexer data.

``dosa_jax.datasets.trained`` is the entry point the library uses (the indexers' q, k, w
on held-out text); ``sparse_attention.forward_sparse`` runs the model with each layer
attending to the keys ``jax.jit(dosa_jax.topk)`` selects from its indexer's scores.
``dosa_jax/lm/README.md`` has the training recipe and the measured results.
"""
