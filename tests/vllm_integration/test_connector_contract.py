"""Parts of vLLM's connector contract around kvtier, without an engine run.

- ``--kv-offloading-size`` next to kvtier is a startup error (vLLM 0.32 would silently replace
  kvtier with its own OffloadingConnector in ``VllmConfig._post_init_kv_transfer_config``):
  refused by the plugin entry point while vLLM builds its config, and by
  ``KVTierConnector.__init__`` should a vLLM build kvtier next to it. The engine run is in
  ``test_e2e_multiconnector.py``.
- kvtier as a child of vLLM's ``MultiConnector``: its lookups, through vLLM's own
  ``MultiConnector.get_num_new_matched_tokens``, against a sibling that has a hit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sched_harness import BLOCK, Harness, request
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)

from kvtier.core.errors import ConfigError
from kvtier.vllm_integration.connector import KVTierConnector
from kvtier.vllm_integration.plugin import register

KVTIER = {"kv_connector": "KVTierConnector", "kv_role": "kv_both"}
EXAMPLE = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}


def vllm_config(ktc: dict, size: float | None) -> VllmConfig:
    # The device named: a vLLM build for another device (tests-vllm-next's) infers none here.
    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(kv_offloading_size=size),
        kv_transfer_config=KVTransferConfig(**ktc),
    )


@pytest.mark.parametrize(
    "ktc",
    [
        KVTIER,
        {**KVTIER, "kv_connector_module_path": "kvtier.vllm_integration.connector"},
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [EXAMPLE, KVTIER]},
        },
    ],
    ids=["by-name", "by-module-path", "multiconnector-child"],
)
def test_offloading_size_next_to_kvtier_is_a_startup_error(ktc: dict) -> None:
    register()
    register()  # vLLM loads plugins more than once per process: the check is installed once
    with pytest.raises(ValueError) as exc:  # pydantic wraps the ConfigError of __post_init__
        vllm_config(ktc, 4.0)
    text = str(exc.value)
    assert "--kv-offloading-size" in text and "kv_offloading_size=4.0" in text
    assert "--kv-transfer-config" in text and "kvtier" in text
    assert f"kv_connector={ktc['kv_connector']!r}" in text


def test_offloading_size_alone_and_kvtier_alone_are_unchanged() -> None:
    register()
    assert vllm_config(EXAMPLE, 4.0).kv_transfer_config.kv_connector == "OffloadingConnector"
    assert vllm_config(KVTIER, None).kv_transfer_config.kv_connector == "KVTierConnector"


def test_the_connector_refuses_to_run_next_to_offloading() -> None:
    """A vLLM that built kvtier next to its own offloading (wrapping instead of replacing)."""
    config = vllm_config(KVTIER, None)
    config.cache_config.kv_offloading_size = 2.0
    with pytest.raises(ConfigError, match="--kv-offloading-size") as exc:
        KVTierConnector(config, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]
    assert "--kv-transfer-config" in str(exc.value)


# -- MultiConnector ------------------------------------------------------------------------


class Sibling:
    """Another child connector whose lookup has ``hit`` tokens at once."""

    def __init__(self, hit: int) -> None:
        self.hit = hit
        self.asked = 0

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> tuple[int, bool]:
        self.asked += 1
        return self.hit, False


def multi(harness: Harness, sibling: Sibling, kvtier_first: bool = True) -> MultiConnector:
    """vLLM's ``MultiConnector`` over kvtier's scheduler half (the harness's) and ``sibling``;
    only its lookup is used, so it is built without a vLLM config."""
    kvtier = KVTierConnector.__new__(KVTierConnector)
    kvtier._scheduler, kvtier._worker = harness.sched, None
    connector = MultiConnector.__new__(MultiConnector)
    children: list = [kvtier, sibling] if kvtier_first else [sibling, kvtier]
    connector._connectors = children
    connector._requests_to_connector = {}
    return connector


PROMPT = list(range(1000, 1000 + 4 * BLOCK + 5))
SIBLING_HIT = 4 * BLOCK


@pytest.mark.parametrize("kvtier_first", [True, False])
def test_a_miss_the_index_rules_out_lets_a_siblings_hit_through(kvtier_first: bool) -> None:
    """Every worker has reported (the index is complete): kvtier answers its miss at once, and
    the sibling's hit is the request's in the same step, whichever child comes first."""
    harness = Harness.create()
    try:
        sibling = Sibling(SIBLING_HIT)
        connector = multi(harness, sibling, kvtier_first)
        req = request(PROMPT)
        assert connector.get_num_new_matched_tokens(req, 0) == (SIBLING_HIT, False)
        assert connector._requests_to_connector[req.request_id] == (1 if kvtier_first else 0)
        assert harness.sched.lookups.sent == 0  # no probe: nothing to wait for
    finally:
        harness.close()


def test_kvtiers_hit_is_loaded_by_kvtier_when_it_comes_first() -> None:
    harness = Harness.create()
    try:
        stored = request(PROMPT)
        harness.store(stored)
        connector = multi(harness, Sibling(SIBLING_HIT))
        req = request(PROMPT)
        answers = [connector.get_num_new_matched_tokens(req, 0)]
        while answers[-1][0] is None and len(answers) < 4:
            harness.step()  # kvtier's probe of a prompt its index knows
            answers.append(connector.get_num_new_matched_tokens(req, 0))
        assert answers[-1][0] == 4 * BLOCK
        assert connector._requests_to_connector[req.request_id] == 0
    finally:
        harness.close()


@pytest.mark.parametrize("kvtier_first", [True, False])
def test_a_miss_does_not_hold_a_siblings_hit_back_before_the_first_report(kvtier_first) -> None:
    """Host memory only: before the workers' first report kvtier's index is empty, not unknown
    (nothing was stored before the process started), so kvtier answers its miss at once."""
    harness = Harness.create(report_first=False)
    try:
        sibling = Sibling(SIBLING_HIT)
        connector = multi(harness, sibling, kvtier_first)
        assert connector.get_num_new_matched_tokens(request(PROMPT), 0) == (SIBLING_HIT, False)
    finally:
        harness.close()


@pytest.mark.xfail(
    strict=True,
    reason="kvtier's 'not yet' while it probes a prompt a tier it cannot list yet (a disk tier "
    "before the first report; Redis always) might hold makes MultiConnector answer None for "
    "every child (multi_connector.py get_num_new_matched_tokens): the sibling's hit waits one "
    "step for kvtier's probe",
)
@pytest.mark.parametrize("kvtier_first", [True, False])
def test_a_probe_does_not_hold_a_siblings_hit_back(kvtier_first: bool, tmp_path) -> None:
    """The contract where kvtier must probe; vLLM's MultiConnector returns (None, False) on any
    child's None, even when a child before kvtier already has its hit (the one it would
    pick)."""
    harness = Harness.create(report_first=False, **lower_tier(tmp_path))
    try:
        sibling = Sibling(SIBLING_HIT)
        connector = multi(harness, sibling, kvtier_first)
        assert connector.get_num_new_matched_tokens(request(PROMPT), 0) == (SIBLING_HIT, False)
    finally:
        harness.close()


def lower_tier(tmp_path) -> dict:
    return {"tiers": ["local_cpu", "local_disk"], "local_disk_path": str(tmp_path / "disk")}


def test_a_probe_holds_a_siblings_hit_back_for_one_step(tmp_path) -> None:
    """What happens there instead (the xfail above): the sibling's hit is delayed, not lost;
    it is the request's once the workers' answer (a miss) has come back, a step later."""
    harness = Harness.create(report_first=False, **lower_tier(tmp_path))
    try:
        sibling = Sibling(SIBLING_HIT)
        connector = multi(harness, sibling)
        req = request(PROMPT)
        assert connector.get_num_new_matched_tokens(req, 0) == (None, False)
        assert sibling.asked == 0  # MultiConnector stops at kvtier's None
        harness.step()
        assert connector.get_num_new_matched_tokens(req, 0) == (SIBLING_HIT, False)
        assert connector._requests_to_connector[req.request_id] == 1
    finally:
        harness.close()


@pytest.mark.parametrize("role", ["kv_both", "kv_producer", "kv_consumer"])
def test_kvtier_needs_no_kv_delivery_in_any_role(role: str) -> None:
    """A best-effort cache, as vLLM's own offloading connectors answer (vLLM's default is True
    for every role that saves): a save that does not happen is a later miss (a consumer's bounded wait
    covers a producer's), so vLLM keeps a preempted request's in-flight output
    (``drop_stale_output``) instead of recomputing it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    register()  # kvtier's vLLM plugin: the connector factory knows KVTierConnector
    config = vllm_config({**KVTIER, "kv_role": role, "engine_id": f"contract-{role}"}, None)
    connector = KVTierConnector(config, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]
    try:
        assert connector.requires_kv_delivery is False
        assert connector.scheduler_side.saves_enabled == (role != "kv_consumer")
        assert KVConnectorBase_V1.requires_kv_delivery.fget(connector) == (role != "kv_consumer")
    finally:
        connector.shutdown()


def test_sleep_mode_is_refused_by_name_with_its_reason(caplog) -> None:
    """vLLM 0.33 asks ``supports_sleep_mode`` before it accepts ``--enable-sleep-mode`` (its
    default is True) and then calls ``unregister_kv_caches`` / ``restore_kv_caches`` around
    sleep: kvtier answers False, saying why, and the two hooks raise rather than do nothing
    while its threads could read released memory. (0.32 has neither; the question is kvtier's
    own classmethod here, asked as vLLM 0.33's ``VllmConfig`` and ``MultiConnector`` ask it.)"""
    import logging

    ktc = KVTransferConfig(**KVTIER)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert KVTierConnector.supports_sleep_mode(ktc) is False
    assert "sleep mode" in caplog.text and "unregister_kv_caches" in caplog.text
    register()
    config = vllm_config({**KVTIER, "engine_id": "contract-sleep"}, None)
    connector = KVTierConnector(config, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]
    try:
        for hook in (connector.unregister_kv_caches, connector.restore_kv_caches):
            with pytest.raises(NotImplementedError, match="sleep mode"):
                hook()
    finally:
        connector.shutdown()
    # vLLM 0.32 never asks: an engine configured with sleep mode is refused at the start.
    asleep = vllm_config({**KVTIER, "engine_id": "contract-asleep"}, None)
    asleep.model_config = SimpleNamespace(enable_sleep_mode=True)  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="enable_sleep_mode"):
        KVTierConnector(asleep, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_the_connector_is_built_for_both_roles_over_vllms_cache_config(role) -> None:
    """Both halves built as vLLM builds them (its ``VllmConfig``, its ``KVCacheConfig``), then
    shut down: what ``tests-vllm-next`` checks of a newer vLLM's constructor and config API
    (a worker's views and model come with ``register_kv_caches``, in an engine)."""
    from fixtures.kv_views import vllm_kv_cache_config
    from kvtier.core.layout import KVLayout

    register()
    config = vllm_config({**KVTIER, "engine_id": f"contract-{role.name}"}, None)
    config.cache_config.block_size = 16
    kv_cache_config = vllm_kv_cache_config(KVLayout(2, 2, 16, "bfloat16", 16), 8)
    connector = KVTierConnector(config, role, kv_cache_config)
    try:
        assert connector.block_size == 16
        if role == KVConnectorRole.SCHEDULER:
            assert connector.scheduler_side.loads_enabled
        else:
            assert connector._worker is not None and connector._worker.engine is None
    finally:
        connector.shutdown()
