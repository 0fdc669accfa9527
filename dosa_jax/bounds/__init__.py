"""The certificate's pieces, one idea per module, as pure jnp functions of one query.

* :mod:`.heads`: activation frequencies and the retained-head choice (Sec. 2.2, DESIGN §4).
* :mod:`.positive`: positive projection, folded weights and the residual
  allowances: triangle (Eq. 4–6), joint (Eq. 7), grouped (App. A.1).
* :mod:`.negative`: negative aggregate with its support rules (Eq. 8).
* :mod:`.certificate`: the certificate (Eq. 9) and its absolute-value form (Eq. 24–25).
* :mod:`.allowance_estimate`: real-number residual allowances of many candidate retained
  sets (the automatic budget's pricing; estimates, never bounds).

Functions take one query's arrays (``q`` [H, D], ``w`` [H], ...); batch with ``jax.vmap``.
"""
