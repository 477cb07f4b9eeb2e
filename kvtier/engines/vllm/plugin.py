"""``vllm.general_plugins`` entry point: makes ``kv_connector="kvtier"`` resolvable in every vLLM process."""

from __future__ import annotations

import logging
import sys

NAME = "kvtier"


def register() -> None:
    """Register the connector once; vLLM's factory raises on a second registration of a name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "kvtier.engines.vllm.connector", "KvtierConnector")
    _show_logs()


def _show_logs() -> None:
    """kvtier's start-up line and warnings in the engine's output, beside vLLM's own lines (vLLM
    configures only its own logger; without this, kvtier's INFO lines would go nowhere)."""
    logger = logging.getLogger(NAME)
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
