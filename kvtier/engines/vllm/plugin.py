"""``vllm.general_plugins`` entry point: makes ``kv_connector="kvtier"`` resolvable in every vLLM process."""

from __future__ import annotations

import logging
import os
import sys

NAME = "kvtier"


def register() -> None:
    """Register the connector once; vLLM's factory raises on a second registration of a name.
    On a vLLM older than kvtier supports, log one sentence and register nothing (a plugin that
    raised would stop vLLM for every use, not only for ``kv_connector="kvtier"``)."""
    _show_logs()
    from kvtier.engines.vllm.compat import check_version

    try:
        check_version()
    except RuntimeError as exc:
        logging.getLogger(NAME).warning("%s", exc)
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", None)  # private: ask only where it exists
    if registry is not None and NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(NAME, "kvtier.engines.vllm.connector", "KvtierConnector")
    except ValueError:  # registered already, in a release that hides its registry
        pass


def _show_logs() -> None:
    """kvtier's start-up line and warnings in the engine's output, beside vLLM's own lines (vLLM
    configures only its own logger; without this, kvtier's INFO lines would go nowhere). Level:
    ``KVTIER_LOG_LEVEL``, else DEBUG when ``VLLM_LOGGING_LEVEL`` is DEBUG (one line per reload),
    else INFO: quieting vLLM does not hide kvtier's warnings."""
    logger = logging.getLogger(NAME)
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    debug = os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "DEBUG"
    logger.setLevel(os.environ.get("KVTIER_LOG_LEVEL") or ("DEBUG" if debug else "INFO"))
