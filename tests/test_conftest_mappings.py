"""The test run's guard on memory mappings (``conftest.pytest_runtest_teardown``)."""

import jax
import jax.numpy as jnp
import pytest

import conftest


@pytest.mark.skipif(conftest._map_limit() is None, reason="no vm.max_map_count here")
def test_past_the_share_compiled_programs_are_dropped(monkeypatch):
    f = jax.jit(lambda x: x * 3 + 1)
    f(jnp.ones(3))
    assert f._cache_size() == 1
    monkeypatch.setattr(conftest, "MAP_SHARE", float("inf"))    # below the share: kept
    conftest.pytest_runtest_teardown(None, None)
    assert f._cache_size() == 1
    monkeypatch.setattr(conftest, "MAP_SHARE", 0.0)             # past it: dropped
    before = conftest._mappings()
    conftest.pytest_runtest_teardown(None, None)
    assert f._cache_size() == 0
    assert conftest._mappings() <= before
    assert float(f(jnp.ones(3))[0]) == 4.0                       # and compiled again on use
