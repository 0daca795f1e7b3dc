"""A host budget for the whole engine (``local_cpu_size_gb_total``) next to the per-worker one
(``local_cpu_size_gb``): config errors, the even split over the engine's workers (tensor x
pipeline parallel, as vLLM's ``cpu_bytes_to_use``). The split through real vLLM with tensor
parallelism 2 is checked in test_e2e_tp.py (each rank's budget and arena)."""

from __future__ import annotations

import pytest

from kvtier.core.config import KVTierConfig, load_config
from kvtier.core.errors import ConfigError


def test_the_total_is_split_evenly_over_the_workers() -> None:
    cfg = load_config(env={}, overrides={"local_cpu_size_gb_total": 8})
    assert cfg.local_cpu_size_gb_total == 8.0
    for world, share in ((1, 8.0), (2, 4.0), (8, 1.0)):
        worker = cfg.per_worker(world)
        assert worker.local_cpu_size_gb == share
        assert worker.local_cpu_size_gb_total is None  # resolved: the worker's own size
    plain = load_config(env={}, overrides={"local_cpu_size_gb": 3})
    assert plain.per_worker(4) is plain  # without a total, the size is per worker


@pytest.mark.parametrize(
    ("env", "overrides"),
    [
        ({}, {"local_cpu_size_gb_total": 8, "local_cpu_size_gb": 1}),
        ({}, {"local_cpu_size_gb_total": 8, "local_cpu_size_gb": 2.0}),  # even the default
        ({"KVTIER_LOCAL_CPU_SIZE_GB": "4"}, {"local_cpu_size_gb_total": 8}),
        ({"KVTIER_LOCAL_CPU_SIZE_GB_TOTAL": "8"}, {"local_cpu_size_gb": 4}),
    ],
)
def test_both_budgets_are_an_error_naming_both(env: dict, overrides: dict) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(env=env, overrides=overrides)
    assert "local_cpu_size_gb_total" in str(exc.value) and "local_cpu_size_gb is set" in str(
        exc.value
    )


def test_both_budgets_through_the_constructor_and_bad_totals() -> None:
    with pytest.raises(ConfigError, match="local_cpu_size_gb is set"):
        KVTierConfig(local_cpu_size_gb=4, local_cpu_size_gb_total=8)
    for bad in (0, -1, float("inf")):
        with pytest.raises(ConfigError, match="local_cpu_size_gb_total"):
            KVTierConfig(local_cpu_size_gb_total=bad)
    with pytest.raises(ConfigError, match="local_cpu_size_gb_total"):
        load_config(env={}, overrides={"local_cpu_size_gb_total": "lots"})
