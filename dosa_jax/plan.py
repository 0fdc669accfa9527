"""The screening plan: everything the key-side scan needs, prepared per query.

Data flows one way (STYLE.md): inputs -> plan (this module: query side) ->
screen -> refine -> select. A plan holds, for each query t, the rows and
weights of the certificate (Eq. 9) in the one shape that serves every
scoring stage (DESIGN §13):

    y_r = rows[t, r] · k̄_i                      (retained heads, r < R)
    z   = Σ_a aggregate[t, a] · k̄_i             (negative aggregate rows, Eq. 8;
                                                 summed *before* the ReLU)
    Û   = Σ_r row_weights[t, r] relu(y_r) − (z if aggregate_linear[t] else relu(z))
    U^num = up[ α_i ( Û + n_i (residual[t] + error[t]) + eps_raw[t] ) ]   (Eq. 26–28)

with ``n_i ≥ ‖k̄_i‖`` the key-norm upper bound. A key survives unless
``U^num < τ`` (strict); ``prune[t] = False`` disables rejection for query t.
The plan is built by :func:`dosa_jax.planner.build_plan`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

Array = jax.Array


class ScreeningPlan(NamedTuple):
    """Per-query screening plan (leading axis T).

    Attributes:
      rows: [T, R, D] float32 retained head vectors q_j (zero rows pad unused slots).
      row_weights: [T, R] float32 folded weights w̃_j (Eq. 6); 0 for padding.
      aggregate: [T, A, D] float32 negative-aggregate rows a_A = Σ_a rows (Eq. 8).
      aggregate_linear: [T] bool, absolute-value form (Eq. 24–25): subtract z, not relu(z).
      residual: [T] float32 upper bound on the positive residual coefficient
        (E_P, E_P^joint or grouped; Eq. 6, 7, App. A.1), multiplies n_i.
      error: [T] float32 numeric coefficient C (App. C, Eq. 26–28), multiplies n_i.
      eps_raw: [T] float32 absolute allowance before scaling (underflow).
      prune: [T] bool; False when the plan is not verified (non-finite values):
        the query must not reject any key.
      retained: [T] int32 number of retained heads actually used (≤ R).
    """

    rows: Array
    row_weights: Array
    aggregate: Array
    aggregate_linear: Array
    residual: Array
    error: Array
    eps_raw: Array
    prune: Array
    retained: Array
