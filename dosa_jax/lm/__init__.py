"""A small byte-level LM with DeepSeek-V3.2-style DSA indexers, for realistic indexer data.

See ``dosa_jax/lm/README.md`` for the recipe and the measured results, and
``dosa_jax.datasets.trained`` for the entry point the library uses.
"""
