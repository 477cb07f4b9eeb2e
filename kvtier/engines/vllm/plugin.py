"""``vllm.general_plugins`` entry point: makes ``kv_connector="kvtier"`` resolvable in every vLLM process."""

from __future__ import annotations

NAME = "kvtier"


def register() -> None:
    """Register the connector once; vLLM's factory raises on a second registration of a name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "kvtier.engines.vllm.connector", "KvtierConnector")
