"""READs into a decode engine's blocks that do not end, through the real worker halves, real ZMQ
and real NIXL over UCX on loopback (the engine KV is host memory registered as DRAM, standing in
for VRAM). A READ is held in flight by :class:`kvtier.pd.nixl_hold.Hold`: NIXL runs it (or, held
``late``, posts it only when let go), only its state says it still runs.

Every READ into engine blocks has a deadline (``pd_timeout_ms`` after its posting,
:mod:`kvtier.pd.consumer.fence`): one that misses it fails its load, the producer's agent is dropped on the
decode engine's side, and the load is reported (its blocks handed back to vLLM) only then; nothing
else is posted into those blocks meanwhile, and a READ posted late lands nowhere."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from pd_workers import Engine, publish, remote_job, wait_for
from test_pd_hbm import D_BLOCKS, P_BLOCKS, PROMPT, lend, wait_ended
from test_pd_hbm_named import warm
from kvtier.pd import nixl
from kvtier.pd.nixl_hold import Hold

pytestmark = pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed: make test installs nixl-cu12")
TIMEOUT_MS = 600  # the decode engine's pd_timeout_ms: each READ's deadline


@pytest.fixture
def transport() -> str:
    return "nixl"


def into(engine: Engine, first: int = 0):
    """A :class:`Hold` match: READs into ``engine``'s KV (its engine blocks); ``first``: only the first so many."""
    start, seen = engine.kv.data_ptr(), []
    end = start + engine.kv.numel() * engine.kv.element_size()

    def match(op: str, peer: str, local: list[tuple[int, int]]) -> bool:
        if op != "READ" or not any(start <= a < end for a, _ in local):
            return False
        seen.append(peer)
        return not first or len(seen) <= first

    return match


def spy_reads(engine: Engine, monkeypatch) -> list[float]:
    """When each READ into ``engine``'s blocks was posted (monotonic s)."""
    posted, read, match = [], engine.side.nixl.read, into(engine)
    monkeypatch.setattr(engine.side.nixl, "read", lambda peer, local, *a, **k: (
        match("READ", peer, local) and posted.append(time.monotonic()), read(peer, local, *a, **k))[1])
    return posted


def report(d: Engine, req_id: str, producer: str, timeout_s: float = 20.0) -> tuple[float, bool, set[int]]:
    """Once ``req_id``'s load reported: when (monotonic s), whether D still knew the producer's NIXL
    agent ``producer`` just before, and the blocks that failed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        known = producer in d.side.nixl.peer_names
        if req_id in d.side.finished_loads():
            return time.monotonic(), known, d.side.failed_blocks()
        time.sleep(0.002)
    raise AssertionError(f"load of {req_id} never reported")


@pytest.mark.parametrize("teardown", [True, False], ids=["ends-when-dropped", "never-ends"])
@pytest.mark.parametrize("path", ["batched", "early"])
def test_a_read_held_past_its_deadline_fails_its_load_once_the_producers_agent_is_dropped(
        engines, caplog, monkeypatch, path, teardown):
    """Batched: the READ of P's replies; early: the READ of the blocks the params named, posted
    before P's reply. At its deadline the load fails and D drops P's agent (NIXL can no longer
    run the READ into D's blocks); only then is the load reported. A READ that ends then is
    settled at once, one that never does is waited for one more timeout."""
    p, d = engines("p", 1), engines("d", 2, pd_timeout_ms=TIMEOUT_MS)
    if path == "early":
        warm(p, d)  # D learns P's agent and regions: its next pull READs the named blocks early
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p, "t1")
    posted, loaded = spy_reads(d, monkeypatch), d.side.transfers.stats.loaded_chunks
    named = tuple(P_BLOCKS) if path == "early" else ()
    with Hold(into(d), teardown=teardown) as hold, caplog.at_level(logging.WARNING, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, producer_blocks=named),))
        reported_s, known, failed = report(d, "d-req", p.side.nixl.name)
    assert len(hold.transfers) == 1 and len(posted) == 1  # nothing else was READ into D's blocks
    assert not known  # P's agent was dropped before the load reported
    waited_s = reported_s - posted[0]
    assert waited_s >= TIMEOUT_MS / 1000  # not before the READ's deadline
    assert waited_s >= 2 * TIMEOUT_MS / 1000 if not teardown else waited_s < 2 * TIMEOUT_MS / 1000
    assert failed == set(D_BLOCKS)  # recomputed: none of its chunks was reported loaded
    assert p.side.chunk_server.lent_total == 0 and d.side.transfers.stats.loaded_chunks == loaded  # no CPU-tier copy
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvtier.pd.consumer.fence"]
    assert len(warnings) == (1 if teardown else 2) and p.endpoint in warnings[0], warnings
    wait_ended(p)  # D released the transfer
    publish(p, PROMPT, P_BLOCKS, "t2")  # the next pull adds P's agent afresh
    lend(p, "t2")
    d.side.start_loads((remote_job("d-2", PROMPT, D_BLOCKS, "t2", p.endpoint),))
    assert d.wait_loaded("d-2") == set()
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))


@pytest.mark.parametrize("reply", ["other-blocks", "not-lent"])
def test_an_early_read_that_does_not_end_keeps_every_other_copy_out_of_its_blocks(engines, caplog, monkeypatch, reply):
    """The READ of the blocks the params named is held. P's replies then name other blocks (the
    params named wrongly), or P no longer lends them (its lease ran out): once that READ missed
    its deadline, neither a second READ nor the CPU-tier copy may go into those blocks: the
    load fails there."""
    p = engines("p", 1, **({"pd_hbm_lease_ms": 100} if reply == "not-lent" else {}))
    d = engines("d", 2, pd_timeout_ms=TIMEOUT_MS)
    warm(p, d)
    publish(p, PROMPT, P_BLOCKS, "t1")
    if reply == "not-lent":
        assert p.side.settle()
        lend(p, "t1", lease_ms=100)
        wait_ended(p)
    else:
        lend(p, "t1")
    posted, loaded = spy_reads(d, monkeypatch), d.side.transfers.stats.loaded_chunks
    named = tuple(range(30, 37)) if reply == "other-blocks" else tuple(P_BLOCKS)  # P's, not this request's
    with Hold(into(d, first=1)) as hold, caplog.at_level(logging.WARNING, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, producer_blocks=named),))
        reported_s, known, failed = report(d, "d-req", p.side.nixl.name)
    assert len(hold.transfers) == 1 and len(posted) == 1  # no second READ into D's blocks
    assert failed == set(D_BLOCKS) and d.side.transfers.stats.loaded_chunks == loaded  # nor the CPU-tier copy
    assert not known and reported_s - posted[0] >= 2 * TIMEOUT_MS / 1000  # its deadline, then one more timeout
    assert any(r.name == "kvtier.pd.consumer.fence" and p.endpoint in r.getMessage() for r in caplog.records)


def test_a_read_posted_after_its_deadline_never_lands_in_blocks_handed_back(engines):
    """The READ's posting is held: it would land after D reported the load and vLLM reused the
    blocks. D dropped P's agent at the deadline, so when it is let go NIXL refuses it."""
    p, d = engines("p", 1), engines("d", 2, pd_timeout_ms=TIMEOUT_MS)
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p, "t1")
    with Hold(into(d), late=True) as hold:
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
        assert d.wait_loaded("d-req") == set(D_BLOCKS)
        d.kv[:, D_BLOCKS] = 0.0  # vLLM recomputes into the blocks handed back
        hold.let_go()
        wait_for(lambda: hold.transfers[0].state() != "PROC")
    assert hold.transfers[0].state() == "ERR"  # posted to an agent D no longer knows
    assert not d.kv[:, D_BLOCKS].any()  # nothing landed in them


def test_a_read_that_lands_after_the_producers_blocks_were_freed_is_never_reported_loaded(engines):
    """P's blocks are freed while D's READ of them is held (the lease and its grace ran out) and
    take other bytes; the READ lands those before its deadline: D's checksum refuses them, and the
    chunks come from P's CPU tier. (A Release from another connection no longer ends a lease:
    ``test_pd_replay.py``.)"""
    p = engines("p", 1, pd_hbm_lease_ms=100, pd_timeout_ms=300)  # the lease's grace: one timeout
    d = engines("d", 2, pd_timeout_ms=10_000)
    publish(p, PROMPT, P_BLOCKS, "t1")
    assert p.side.settle()
    computed = p.blocks(P_BLOCKS)
    lend(p, "t1", lease_ms=100)
    with Hold(into(d), late=True) as hold:
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
        wait_for(lambda: hold.transfers)  # D READs P's blocks: held before its bytes move
        wait_ended(p)  # P's blocks are free
        p.kv[:, P_BLOCKS] += 1.0  # and reused
        hold.let_go()  # the READ lands now
        failed = d.wait_loaded("d-req")
    assert failed == set()
    assert torch.equal(d.blocks(D_BLOCKS), computed)  # not the reused blocks' bytes: P's CPU-tier copies
    assert d.side.transfers.stats.landed_bytes == 0 and p.side.chunk_server.lent_total == 4
