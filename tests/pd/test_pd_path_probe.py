"""A consumer knows whether its HBM path to a producer is direct before its first request depends
on it (kvtier.pd.hbm.direct_path): one test READ at the first handshake, then every chunk of
that first transfer already comes the right way.

Real worker halves, real NIXL over UCX on loopback. The engine KV is host memory registered as
DRAM, which kvtier does not judge (host memory moves at host speed): these tests count DRAM as
judged and set the bar between "direct" and "emulated" above or below any speed, which is the
only stand-in here (no GPU, so no emulated GPU path to run)."""

from __future__ import annotations

import logging

import pytest
import torch

from pd_workers import Engine, prompt_keys, publish, remote_job, tokens_of
from kvtier.jobs import Lend
from kvtier.pd import hbm, nixl

PROMPT = tokens_of(100)  # three full chunks and a 4-token tail: 7 blocks
P_BLOCKS = [10, 11, 12, 13, 20, 21, 22]
D_BLOCKS = list(range(40, 47))

pytestmark = pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed: make test installs nixl-cu12")


@pytest.fixture
def transport() -> str:
    return "nixl"


@pytest.fixture
def judged_paths(monkeypatch):
    """Host memory judged as GPU memory would be; ``bar(gbps)`` sets the emulated bar."""
    monkeypatch.setattr(hbm, "JUDGED_KINDS", ("VRAM", "DRAM"))
    monkeypatch.setattr(hbm, "_timed", {})
    monkeypatch.setattr(hbm, "_emulated", set())
    return lambda gbps: monkeypatch.setattr(hbm, "EMULATED_GBPS", gbps)


def lend(p: Engine) -> None:
    full, tail = prompt_keys(PROMPT)
    p.side.lend((Lend("p-req", "t1", tuple(P_BLOCKS), tuple(full + [tail]), 2000),))


def spy_fetches(p: Engine, monkeypatch) -> list[bool]:
    """Each fetch P's server sees: whether it asked for engine blocks (HBM)."""
    asked, server = [], p.side.chunk_server
    fetch = server._fetch
    monkeypatch.setattr(server, "_fetch", lambda identity, f, now: (asked.append(f.hbm), fetch(identity, f, now))[1])
    return asked


def test_a_slow_path_is_found_before_the_first_transfer_asks_for_a_block(engines, judged_paths, monkeypatch, caplog):
    judged_paths(1e9)  # any path is slower than this: emulated
    p, d = engines("p", 1), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p)
    asked = spy_fetches(p, monkeypatch)
    with caplog.at_level(logging.INFO, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
        assert d.wait_loaded("d-req") == set()
    assert asked and not any(asked)  # the first transfer's every chunk came through the CPU tiers
    assert p.side.chunk_server.hbm_total == 0 and p.side.chunk_server.lent_total == 4
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))  # the test READ's bytes were overwritten
    assert hbm.emulated(p.endpoint) and "test READ" in caplog.text and "no direct GPU path" in caplog.text


def test_a_direct_path_is_used_from_the_first_transfer_on(engines, judged_paths, monkeypatch, caplog):
    judged_paths(1e-6)  # any path is faster than this: direct
    p, d = engines("p", 1), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p)
    with caplog.at_level(logging.INFO, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
        assert d.wait_loaded("d-req") == set()
    assert p.side.chunk_server.hbm_total == 4 and p.side.chunk_server.lent_total == 0
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    assert hbm.judged(p.endpoint) and not hbm.emulated(p.endpoint) and "per test READ" in caplog.text


def test_a_test_read_that_fails_sends_the_transfer_through_the_cpu_tiers(engines, judged_paths, monkeypatch):
    """The producer's regions as its reply gave them cannot be read (here: shifted past what it
    registered, so NIXL itself refuses the READ): judged emulated at once, nothing recomputed."""
    judged_paths(1e-6)
    p, d = engines("p", 1), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p)
    serving = p.side.chunk_server._hbm
    hello = serving.hello
    monkeypatch.setattr(serving, "hello", lambda *a, **k: (lambda r: (tuple(
        (base + (1 << 40), stride, n) for base, stride, n in r[0]), *r[1:]))(hello(*a, **k)))
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set()
    assert hbm.emulated(p.endpoint) and p.side.chunk_server.hbm_total == 0
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))


@pytest.mark.parametrize("gbps, direct", [(100.0, True), (0.4, False)], ids=["direct", "emulated"])
def test_what_every_read_costs_whatever_its_size_is_not_taken_for_a_slow_path(judged_paths, monkeypatch, gbps, direct):
    """A stand-in for NIXL and the clock (no GPU here): every READ costs 1 ms whatever its size
    (vLLM 0.33's engine KV is one allocation, mapped per transfer), then moves ``gbps``. A probe of
    16 blocks of 64 KiB (1 MiB in 1.01 ms at 100 GB/s: ~1 GB/s read whole) is judged by the
    difference with a one-block READ: direct at 100 GB/s, emulated at 0.4."""
    from types import SimpleNamespace

    from kvtier.pd.consumer import probe

    judged_paths(hbm.EMULATED_GBPS)
    block_bytes, now = 64 << 10, [0.0]

    class Fence:
        def __init__(self, *args):
            pass

        def track(self, read):
            return read

        def wait(self, read, timeout_s):
            now[0] += 1e-3 + read.blocks * block_bytes / (gbps * 1e9)

    read = lambda peer, local, remote, memory, here: SimpleNamespace(blocks=local, release=lambda: None)  # noqa: E731
    monkeypatch.setattr(probe, "Fence", Fence)
    monkeypatch.setattr(probe, "compatible", lambda mine, theirs: True)
    monkeypatch.setattr(probe, "read_descriptors", lambda mine, theirs, blocks, ids: (len(blocks), len(blocks)))
    monkeypatch.setattr(probe, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    mine = hbm.Landing((hbm.RegionSpan(0, block_bytes, block_bytes),), "VRAM", 0, [tuple(range(16))])
    endpoint = f"tcp://probe-{gbps}"
    assert probe.direct_path(SimpleNamespace(read=read), "peer", endpoint, mine, mine.regions, 0, 1000) is direct
    assert hbm.emulated(endpoint) is not direct
