"""Fixtures of the P/D tests: worker halves made by :func:`pd_workers.make_engine`, closed after."""

from __future__ import annotations

import pytest

from pd_workers import Engine, make_engine


@pytest.fixture
def engines(tmp_path):
    made: list[Engine] = []

    def make(name: str, seed: int, **kw) -> Engine:
        engine = make_engine(tmp_path, name, seed, **kw)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.side.close()


