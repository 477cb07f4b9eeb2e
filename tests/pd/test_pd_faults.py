"""kvtier.pd.faults: the engine fault hooks cost nothing unset, parse their variable, strike at the
drawn rate with the seed's draws, and corrupt only the chunk handed to them."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtier.codec import HEADER_BYTES
from kvtier.pd import faults
from kvtier.pd.hbm import Landing, RegionSpan


@pytest.fixture(autouse=True)
def _off_after():
    yield
    faults.configure(None)


def test_the_variable_parses_and_round_trips():
    spec = faults.parse("corrupt_chunk=0.05, delay_read_ms=200:0.1,seed=7")
    assert spec == faults.FaultSpec(0.05, 200.0, 0.1, 7)
    assert faults.parse(spec.text()) == spec
    assert faults.parse("delay_read_ms=50") == faults.FaultSpec(delay_read_ms=50.0, delay_read_p=1.0)
    assert faults.parse("") is None and faults.parse("  ") is None
    for bad in ("corrupt_chunk=2", "corrupt_chunk=x", "delay_read_ms=-1", "seed=1.5", "flip=0.1"):
        with pytest.raises(ValueError, match=faults.ENV):
            faults.parse(bad)


def test_unset_every_hook_returns_at_once_and_touches_nothing():
    faults.configure(None)
    data = torch.arange(256, dtype=torch.uint8)
    chunk = SimpleNamespace(data=data.clone())
    assert faults.corrupt(chunk) is chunk and torch.equal(chunk.data, data)
    assert faults.read_delay_s() == 0.0 and faults.delay_read() == 0.0 and not faults.active()
    assert faults.counts == {"corrupt": 0, "delay_read": 0}


def test_corrupt_flips_one_payload_byte_of_a_chunk_buffer_and_logs_it(caplog):
    faults.configure(faults.FaultSpec(corrupt_chunk=1.0, seed=1))
    data = torch.arange(HEADER_BYTES + 512, dtype=torch.int64).to(torch.uint8)
    chunk = SimpleNamespace(data=data.clone())
    with caplog.at_level(logging.WARNING, logger="kvtier.pd.faults"):
        assert faults.corrupt(chunk) is chunk
        faults.corrupt(SimpleNamespace(data=data.clone()))
    differs = (chunk.data != data).nonzero().flatten().tolist()
    assert len(differs) == 1 and differs[0] >= HEADER_BYTES  # the header is left whole: the payload is corrupt
    assert faults.counts["corrupt"] == 2
    assert sum(faults.MARK + " corrupt," in r.message for r in caplog.records) == 2
    assert sum(faults.IN_USE + " corrupt " in r.message for r in caplog.records) == 1


def test_corrupt_flips_a_byte_of_the_first_landed_block_in_host_memory():
    faults.configure(faults.FaultSpec(corrupt_chunk=1.0))
    kv = np.zeros((8, 64), dtype=np.uint8)  # 8 blocks of 64 bytes
    region = RegionSpan(kv.ctypes.data, 64, 64)
    landing = Landing((region,), "DRAM", 0, [None, (5, 6)])
    landed = object()
    assert faults.corrupt(landed, landing, 1) is landed
    assert np.count_nonzero(kv) == 1 and np.count_nonzero(kv[5]) == 1
    faults.corrupt(landed, Landing((region,), "VRAM", 0, [(2,)]), 0)  # GPU memory: not reachable here
    faults.corrupt(landed, landing, 0)  # no blocks named for that chunk
    assert np.count_nonzero(kv) == 1


def test_strikes_follow_the_rate_and_the_seed():
    faults.configure(faults.FaultSpec(delay_read_ms=10.0, delay_read_p=0.25, seed=3))
    first = [faults.read_delay_s() for _ in range(2000)]
    faults.configure(faults.FaultSpec(delay_read_ms=10.0, delay_read_p=0.25, seed=3))
    assert [faults.read_delay_s() for _ in range(2000)] == first
    struck = [d for d in first if d]
    assert 400 < len(struck) < 600 and all(0.005 <= d <= 0.015 for d in struck)
    faults.configure(faults.FaultSpec(delay_read_ms=20.0, delay_read_p=1.0))
    begin = time.perf_counter()
    slept = faults.delay_read()
    assert 0.01 <= slept <= time.perf_counter() - begin + 1e-3
