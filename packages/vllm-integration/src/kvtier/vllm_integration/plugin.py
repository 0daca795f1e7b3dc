"""vLLM plugin entry point: registers ``KVTierConnector`` with vLLM's KV-connector factory.

vLLM runs every ``vllm.general_plugins`` entry point in every process it starts (front end,
EngineCore, workers), sometimes more than once per process, so registration is idempotent.
Registration is lazy (module path + class name): nothing of kvtier is imported until an engine
is configured with ``kv_connector="KVTierConnector"``.
"""

from __future__ import annotations

import threading

CONNECTOR_NAME = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.vllm_integration.connector"

_lock = threading.Lock()


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with _lock:
        if CONNECTOR_NAME in KVConnectorFactory._registry:
            return
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
