"""The K-th largest order key of each row (pallas_kernels.kth_largest) against its twin."""

import numpy as np
import jax.numpy as jnp
import pytest

import dosa_jax
from dosa_jax.selection import INT32_MIN, order_key
from pallas_kernels.kth_largest import kth_largest, kth_largest_reference

IMAX = np.iinfo(np.int32).max
ON_GPU = dosa_jax.backend.on_gpu()


def _rows(rng, W):
    """Adversarial rows: the int32 extremes, all equal, many ties at the K-th, one non-min
    key, order keys of floats of both signs with ±0, ±inf, and uniform keys."""
    full = rng.integers(INT32_MIN, IMAX, size=W, endpoint=True, dtype=np.int64).astype(np.int32)
    f = rng.standard_normal(W).astype(np.float32) * 1e3
    f[:4] = [0.0, -0.0, np.inf, -np.inf]
    rows = [np.full(W, INT32_MIN, np.int32), np.full(W, IMAX, np.int32),
            np.full(W, -7, np.int32),
            np.where(np.arange(W) % 3 == 0, IMAX, INT32_MIN).astype(np.int32),
            np.where(np.arange(W) == W // 2, 5, INT32_MIN).astype(np.int32),
            rng.integers(-3, 3, size=W).astype(np.int32),            # ties everywhere
            np.asarray(order_key(jnp.asarray(f))), full, -full, full ^ np.int32(1)]
    return np.stack(rows)


@pytest.mark.parametrize("W", [16, 100, 1000])
def test_kth_largest_is_top_ks_kth_value_on_adversarial_rows(W):
    """Bitwise ``lax.top_k(x, K)[0][:, K - 1]`` for K = 1, 2, W/2, W − 1, W (the row padded
    to a power of two with INT32_MIN when it is not one)."""
    x = jnp.asarray(_rows(np.random.default_rng(W), W))
    for K in sorted({1, 2, W // 2, W - 1, W}):
        got = np.asarray(kth_largest(x, K, interpret=True))
        want = np.asarray(kth_largest_reference(x, K))
        np.testing.assert_array_equal(got, want, err_msg=f"W={W} K={K}")


def test_kth_largest_checks_its_arguments():
    x = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="K must be in"):
        kth_largest(x, 9, interpret=True)
    with pytest.raises(ValueError, match="K must be in"):
        kth_largest(x, 0, interpret=True)
    with pytest.raises(ValueError, match="x must be int32"):
        kth_largest(x.astype(jnp.float32), 1, interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_compiled_kth_largest_matches_top_k():
    """The compiled kernel at the decode's witness shape (rows of 8192, K = 2048) and odd ones."""
    rng = np.random.default_rng(5)
    for W, K in ((8192, 2048), (1000, 999), (16384, 1)):
        x = jnp.asarray(np.concatenate([_rows(rng, W)] * 4))
        np.testing.assert_array_equal(np.asarray(kth_largest(x, K, interpret=False)),
                                      np.asarray(kth_largest_reference(x, K)))
