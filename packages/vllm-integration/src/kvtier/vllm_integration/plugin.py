"""vLLM plugin entry point: registers ``KVTierConnector`` with vLLM's KV-connector factory.

vLLM runs every ``vllm.general_plugins`` entry point in every process it starts (front end,
EngineCore, workers), sometimes more than once per process, so registration is idempotent.
Registration is lazy (module path + class name): nothing of kvtier is imported until an engine
is configured with ``kv_connector="KVTierConnector"``.

It also refuses vLLM's ``--kv-offloading-size`` next to kvtier: vLLM 0.32's
``VllmConfig._post_init_kv_transfer_config`` then overwrites ``kv_connector`` with its own
OffloadingConnector (or LMCacheMPConnector), so kvtier would silently never run. vLLM builds its
config after loading the plugins (``EngineArgs.__post_init__``), so the check runs first.

And it refuses models that keep a recurrent state (Mamba, linear attention such as Gated
DeltaNet: vLLM's ``is_hybrid``, ``has_inner_state``, ``is_attention_free``) with a named error:
kvtier stores attention KV pages only, and vLLM, which turns its hybrid KV cache manager off for
a connector without ``SupportsHMA``, would otherwise stop later with "Failed to promote local KV
cache specs to one unified type" (docs/hybrid.md). Sliding-window hybrids (Gemma 2/3, gpt-oss)
run, with vLLM's hybrid manager off.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

CONNECTOR_NAME = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.vllm_integration.connector"

logger = logging.getLogger("kvtier")
_lock = threading.Lock()


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with _lock:
        if CONNECTOR_NAME not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
        _refuse_offloading_size()


def _names_kvtier(kv_connector: Any, module_path: Any, extra: Any) -> bool:
    """Whether a kv_transfer_config (or a MultiConnector child's dict) selects kvtier."""
    if kv_connector == CONNECTOR_NAME or str(module_path or "").startswith("kvtier."):
        return True
    children = (extra or {}).get("connectors") if kv_connector == "MultiConnector" else None
    return any(
        _names_kvtier(
            c.get("kv_connector"),
            c.get("kv_connector_module_path"),
            c.get("kv_connector_extra_config"),
        )
        for c in children or ()
        if isinstance(c, dict)
    )


def offloading_size_conflict(
    kv_transfer_config: Any, cache_config: Any, *, is_kvtier: bool = False
) -> str | None:
    """The startup error for kvtier configured next to vLLM's ``kv_offloading_size``, or None.
    ``is_kvtier``: the config is kvtier's own (its connector is being built)."""
    size = getattr(cache_config, "kv_offloading_size", None)
    if size is None or kv_transfer_config is None:
        return None
    ktc = kv_transfer_config
    if not is_kvtier and not _names_kvtier(
        ktc.kv_connector, ktc.kv_connector_module_path, ktc.kv_connector_extra_config
    ):
        return None
    backend = getattr(cache_config, "kv_offloading_backend", "native")
    return (
        f"--kv-offloading-size (kv_offloading_size={size}, backend {backend!r}) and kvtier "
        f"(--kv-transfer-config kv_connector={ktc.kv_connector!r}) are both configured: vLLM "
        "would replace kvtier with its own offloading connector. Drop --kv-offloading-size and "
        "size kvtier's host tier in kv_connector_extra_config (local_cpu_size_gb_total for the "
        "whole engine, as --kv-offloading-size is, or local_cpu_size_gb per worker), or drop "
        "kvtier from --kv-transfer-config to use vLLM's offloading"
    )


def recurrent_state_conflict(kv_transfer_config: Any, model_config: Any) -> str | None:
    """The startup error for kvtier configured for a model with a recurrent state that has no
    attention layers (pure Mamba / linear attention), or None. An attention + Mamba hybrid
    (vLLM's ``is_hybrid``) starts: kvtier stores its states when vLLM serves it in "align" mode
    and refuses it by name once its KV cache groups are known otherwise (``groups.py``)."""
    ktc = kv_transfer_config
    if ktc is None or model_config is None:
        return None
    if not _names_kvtier(
        ktc.kv_connector, ktc.kv_connector_module_path, ktc.kv_connector_extra_config
    ):
        return None
    if _flag(model_config, "is_hybrid"):
        return None
    flags = [f for f in ("has_inner_state", "is_attention_free") if _flag(model_config, f)]
    if not flags:
        return None
    arch = ", ".join(getattr(model_config, "architectures", None) or ["?"])
    return (
        f"model {getattr(model_config, 'model', '?')!r} ({arch}) keeps a recurrent state, "
        f"Mamba or linear attention, and has no attention layers (vLLM: {', '.join(flags)}). "
        "kvtier stores such a state only beside attention layers, for models vLLM serves "
        "with mamba_cache_mode='align' (docs/hybrid.md). Serve this model without kvtier in "
        "--kv-transfer-config"
    )


def _flag(model_config: Any, name: str) -> bool:
    """A ``ModelConfig`` property that needs the model's registry entry; False when it cannot
    be read (an unknown architecture is vLLM's own error to give)."""
    try:
        return bool(getattr(model_config, name, False))
    except Exception:
        return False


def _refuse_offloading_size() -> None:
    """Wrap ``VllmConfig._post_init_kv_transfer_config`` (once) to fail on the conflict before
    vLLM swaps the connector; a vLLM without that method is left alone (the connector's own
    check in ``KVTierConnector.__init__`` remains)."""
    from vllm.config import VllmConfig

    original = getattr(VllmConfig, "_post_init_kv_transfer_config", None)
    if original is None or getattr(original, "_kvtier_checked", False):
        return

    @functools.wraps(original)
    def checked(self: Any) -> None:
        from kvtier.core.errors import ConfigError

        error = offloading_size_conflict(self.kv_transfer_config, self.cache_config)
        if error is not None:
            raise ConfigError("kv_offloading_size", self.cache_config.kv_offloading_size, error)
        state = recurrent_state_conflict(self.kv_transfer_config, self.model_config)
        if state is not None:
            raise ConfigError("model", getattr(self.model_config, "model", None), state)
        original(self)

    checked._kvtier_checked = True  # type: ignore[attr-defined]
    VllmConfig._post_init_kv_transfer_config = checked  # type: ignore[method-assign]
