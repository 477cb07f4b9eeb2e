"""A pull whose ``kv_transfer_params`` name P's engine blocks (``remote_block_ids``): D READs them
before P's handshake reply, through the real worker halves and real NIXL over UCX on loopback,
with host memory standing in for VRAM (as in ``test_pd_hbm.py``).

D READs early only from a producer it reached before (its agent and regions known). P's replies
still decide: blocks named wrongly are READ again from those P names, and a transfer P no longer
lends comes from its CPU tier once the early READ settled, whatever that READ wrote."""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch

from pd_workers import Engine, publish, remote_job
from test_pd_hbm import D_BLOCKS, P_BLOCKS, PROMPT, lend, wait_ended
from kvtier.pd import nixl
from kvtier.pd.consumer import landing

pytestmark = pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed: make test installs nixl-cu12")


@pytest.fixture
def transport() -> str:
    return "nixl"


def early_reads(caplog) -> list[tuple[int, int]]:
    """(READs, chunks READ before P's reply) of each transfer D logged, in order."""
    return [(int(m.group(1)), int(m.group(2))) for m in re.finditer(
        r"chunks landed by (\d+) READs; .*?; (\d+) READ before P's reply", caplog.text)]


def warm(p: Engine, d: Engine, named: tuple[int, ...] = ()) -> None:
    """A first pull: D learns P's agent and regions from the handshake (nothing READ early)."""
    publish(p, PROMPT, P_BLOCKS, "t-warm")
    lend(p, "t-warm")
    d.side.start_loads((remote_job("d-warm", PROMPT, D_BLOCKS, "t-warm", p.endpoint, producer_blocks=named),))
    assert d.wait_loaded("d-warm") == set()
    wait_ended(p, "p-req")


def test_named_blocks_are_read_before_the_producers_reply(engines, caplog, monkeypatch):
    """The READ is posted by the transfer's thread as soon as the hello went, so before D takes any
    of P's replies; every chunk's reply then names the blocks it took: one READ for the transfer."""
    p, d = engines("p", 1), engines("d", 2)
    times: dict[str, float] = {}
    add, read = landing.Landings.add, d.side.nixl.read
    monkeypatch.setattr(landing.Landings, "add", lambda *a: (times.setdefault("reply", time.perf_counter()), add(*a))[1])
    monkeypatch.setattr(d.side.nixl, "read", lambda *a, **k: (times.setdefault("read", time.perf_counter()), read(*a, **k))[1])
    with caplog.at_level(logging.DEBUG, logger="kvtier"):
        warm(p, d, named=tuple(P_BLOCKS))  # named, but P is not known yet: READ once P's replies came
        times.clear()
        publish(p, PROMPT, P_BLOCKS, "t1")
        lend(p, "t1")
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, producer_blocks=tuple(P_BLOCKS)),))
        assert d.wait_loaded("d-req") == set()
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    assert early_reads(caplog) == [(1, 0), (1, 4)]  # one READ each; the second's 4 chunks all READ early
    assert times["read"] < times["reply"]  # posted before D took P's first reply
    wait_ended(p)  # released as any pull: the blocks go at once
    assert p.side.engine_kv.held_bytes == 0


SWAPPED = tuple(P_BLOCKS[:2] + P_BLOCKS[4:6] + P_BLOCKS[2:4] + P_BLOCKS[6:])  # chunks 1 and 2 named swapped
BEYOND = tuple(b + 100_000 for b in P_BLOCKS)  # beyond P's engine KV: not registered with NIXL
TAIL_BEYOND = tuple(P_BLOCKS[:-1]) + (100_000,)  # only the tail's block beyond it
NEIGHBOUR = tuple(P_BLOCKS[:-1]) + (64,)  # one past P's last block: but in the last layer, the next one's first


@pytest.mark.parametrize("named, reads", [(SWAPPED, [(2, 2)]), (BEYOND, [(1, 0)]), (TAIL_BEYOND, [(1, 0)]),
                                          (NEIGHBOUR, [(1, 0)])],
                         ids=["swapped", "beyond", "tail-beyond", "neighbour"])
def test_blocks_named_wrongly_are_read_again_from_those_the_producer_names(engines, caplog, named, reads):
    """Blocks named wrongly (a proxy's mistake, a malformed or hostile parameter) cost a READ,
    never a recompute or a wrong answer. Swapped: those chunks land P's other chunk and are READ
    again, once the early READ settled, from the blocks P's replies name; the rest take the early
    READ. Any block beyond P's engine KV (its handshake's ``num_blocks``), be it far beyond (NIXL
    would refuse it) or just past the end (NIXL would read the next region's bytes: registration
    merges interleaved regions): nothing is READ early, and all are READ from the blocks P names."""
    p, d = engines("p", 1), engines("d", 2)
    warm(p, d)
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p, "t1")
    with caplog.at_level(logging.DEBUG, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, producer_blocks=named),))
        assert d.wait_loaded("d-req") == set()  # nothing recomputed
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    assert early_reads(caplog) == reads  # (READs, chunks that took the early one)


def test_blocks_named_after_the_lease_ended_are_not_used_and_the_cpu_tier_copy_lands(engines, caplog):
    """P's lease ran out and its blocks took other bytes before D asked: the early READ copies
    those into D's blocks, P's reply says it lends nothing, and the CPU tier's copy (P's KV as it
    was computed) replaces them once the READ settled."""
    p, d = engines("p", 1, pd_hbm_lease_ms=100), engines("d", 2)
    warm(p, d)
    publish(p, PROMPT, P_BLOCKS, "t1")
    assert p.side.settle()  # the CPU-tier copies are sealed
    computed = p.blocks(P_BLOCKS)
    lend(p, "t1", lease_ms=100)
    assert wait_ended(p) < 5
    p.kv[:, P_BLOCKS] += 1.0  # the freed blocks reused by another request
    landed = d.side.transfers.stats.landed_bytes
    with caplog.at_level(logging.DEBUG, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, producer_blocks=tuple(P_BLOCKS)),))
        assert d.wait_loaded("d-req") == set()  # no recompute
    assert torch.equal(d.blocks(D_BLOCKS), computed)
    assert p.side.chunk_server.lent_total == 4 and d.side.transfers.stats.landed_bytes == landed
    assert early_reads(caplog) == []  # no chunk landed HBM to HBM


def test_a_producer_whose_agent_went_is_forgotten_with_what_it_lent(engines):
    """Once D's agent no longer knows P's (P's chunk server went away), the early READ has nothing
    to go on (the next pull waits for P's reply), and D's map of the producers it knows drops P."""
    p, d = engines("p", 1), engines("d", 2)
    warm(p, d)
    key = (d.side.nixl.name, p.endpoint)
    peer = landing._known[key][0]
    d.side.nixl.forget(name=peer)  # what D's agent watch does when P's chunk server stops answering
    assert landing.read_early(d.side.nixl, p.endpoint, None, tuple(P_BLOCKS), [], 1.0) is None
    assert key not in landing._known
