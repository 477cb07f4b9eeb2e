"""Fixtures of the P/D tests: worker halves made by :func:`pd_workers.make_engine`, closed after.

Every test runs on both transports: ``zmq`` (chunks as ZMQ frames) and ``nixl`` (real NIXL over
UCX on loopback: D READs from P's registered CPU pool)."""

from __future__ import annotations

import pytest

from kvtier.pd import nixl
from pd_workers import Engine, make_engine


@pytest.fixture(params=["zmq", "nixl"])
def transport(request) -> str:
    if request.param == "nixl" and not nixl.available():
        pytest.fail("NIXL is not installed: make test installs nixl-cu12")
    return request.param


@pytest.fixture
def engines(tmp_path, transport):
    made: list[Engine] = []

    def make(name: str, seed: int, **kw) -> Engine:
        kw.setdefault("pd_transport", transport)
        engine = make_engine(tmp_path, name, seed, **kw)
        made.append(engine)
        if kw["pd_transport"] == "nixl":
            assert engine.side.nixl_ready(), "NIXL did not start"
        return engine

    yield make
    for engine in made:
        engine.side.close()


@pytest.fixture(params=["read", "write"])
def push(request) -> str:
    """A consumer's ``pd_hbm_push``: it READs P's blocks, or P WRITEs into its own."""
    return request.param
