"""Calls inside a user's ``jax.shard_map``: the manual mesh axes an input varies along.

Inside ``shard_map`` (with its default ``check_vma=True``) every value carries the set
of manual mesh axes it varies along, and every primitive must say how its outputs vary.
The reference backend is plain jnp, so it types itself. A ``pallas_call``'s outputs carry
no such type, and its interpret-mode body (CPU) cannot be typed at all, so the kernel
backend is traced with the varying-axes checks off (the way ``pallas_call`` traces its
own kernel bodies) and its outputs are then cast to vary along every axis any input
varies along (DESIGN §12). The cast is the identity on values: a per-device result is
exactly what the same call computes on that device's inputs.
"""

from __future__ import annotations

import contextlib

import jax

__all__ = ["as_varying", "checking_varying_axes", "outside_varying_checks", "varying_axes"]


def _axes_of(x) -> frozenset:
    try:
        aval = jax.typeof(x)
    except TypeError:
        return frozenset()
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def varying_axes(*trees) -> tuple:
    """Sorted names of the manual mesh axes any array leaf of ``trees`` varies along
    (empty outside ``shard_map``)."""
    axes = frozenset()
    for leaf in jax.tree_util.tree_leaves(trees):
        axes |= _axes_of(leaf)
    return tuple(sorted(axes))


def _check_state():
    from jax._src import config as _config
    return getattr(_config, "_check_vma", None)


def checking_varying_axes() -> bool:
    """Whether values traced now are checked for their varying axes (inside a
    ``shard_map`` with ``check_vma=True``)."""
    state = _check_state()
    return bool(state is not None and state.value)


def outside_varying_checks():
    """Context in which traced values are not checked for their varying axes (a no-op
    context when this jax has no such setting)."""
    state = _check_state()
    return state(False) if state is not None else contextlib.nullcontext()


def as_varying(tree, axes: tuple):
    """``tree`` with every array leaf typed as varying along ``axes`` (identity on values;
    leaves already varying along an axis keep it)."""
    if not axes:
        return tree

    def cast(x):
        if not isinstance(x, jax.Array):
            return x
        missing = tuple(a for a in axes if a not in _axes_of(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(cast, tree)
