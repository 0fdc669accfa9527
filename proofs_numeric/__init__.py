"""Numeric checks of the paper's propositions, one module per claim.

Each module has ``check(n_instances=..., seed=...) -> dict`` (counts: instances,
keys or pairs checked, violations, max violation, ...) and a command line
``python -m proofs_numeric.<name>``; ``python -m proofs_numeric`` runs them all
and prints a table. Claims about real numbers are checked in float64 (JAX x64
enabled only inside the check); the enclosure check is about float32.

=========================  ================================================
module                     claim
=========================  ================================================
certificate                U ≥ s on every key, every variant (Eq. 9);
                           U_abs ≥ s, U_abs = U + relu(−a·k) (Eq. 24–25)
joint_allowance            E_P^joint ≤ E_P (Eq. 7); triangle/joint/grouped
                           allowances hold per key; *_upper ≥ exact (App. C)
single_anchor_optimality   Prop. 5: no β ≥ 0 admits c < dist(q, ray βp)
slack_decomposition        Eq. 14 is an identity with non-negative terms
margin_equivalence         Eq. 17: U < τ ⇔ Δ > δ + b (τ ≤ τ*)
exact_selection            Theorem 1: DoSA indices == dense indices
enclosure                  App. C: s_ref ≤ U_num on adversarial FP8 pairs
=========================  ================================================
"""

CHECKS = ("certificate", "joint_allowance", "single_anchor_optimality", "slack_decomposition",
          "margin_equivalence", "exact_selection", "enclosure")
