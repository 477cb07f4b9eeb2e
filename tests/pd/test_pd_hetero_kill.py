"""A rank killed with SIGKILL in the middle of a transfer between engines of different TP sizes, on
both transports: what arrived whole is byte for byte P's, the rest is recomputed within the timeout,
and nothing is left held on the engines that survive (no pinned chunk, no lent or cut buffer, no
CPU-tier buffer beyond the chunks kept).

KV memory as vLLM-CPU lays it out, two KV heads (:func:`pd_workers.make_engine` with ``rank_of``):
at TP=2 rank r holds head r. The dying rank is a worker half in a process of its own
(:mod:`pd_proc`); the others run in the test's process. P seals only the first chunk before the
kill, so some chunks have moved and the rest are still awaited when the rank dies.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.jobs import SaveJob
from kvtier.transfer.pieces import piece_keys
from pd_workers import BLOCK, CHUNK, Engine, make_engine, prompt_keys, publish, remote_job, tokens_of, wait_for
from test_pd_kill import Peer

PROMPT = tokens_of(100)  # three full chunks and a 4-token tail: 7 blocks
P_BLOCKS = list(range(10, 17))
D_BLOCKS = list(range(40, 47))
TIMEOUT_MS = 1000
FIRST = CHUNK // BLOCK  # blocks of the first chunk
SETTLE_S = 3 * TIMEOUT_MS / 1000 + 5  # a dead peer's loans, pins and buffers are given back within this


@pytest.fixture
def ranks(tmp_path, transport):
    """``make(name, seed, (rank, tp_size), in_process, **config)``: that rank of an engine, a worker
    half in the test's process (an :class:`Engine`) or in a process of its own (a :class:`Peer`)."""
    engines: list[Engine] = []
    peers: list[Peer] = []

    def make(name: str, seed: int, of: tuple[int, int], in_process: bool = True, **config):
        config = {"pd_transport": transport, "pd_timeout_ms": TIMEOUT_MS, **config}
        if not in_process:
            peers.append(Peer(tmp_path, name, seed, rank_of=of, **config))
            return peers[-1]
        engines.append(make_engine(tmp_path, name, seed, rank_of=of, **config))
        if transport == "nixl":
            assert engines[-1].side.nixl_ready(), "NIXL did not start"
        return engines[-1]

    yield make
    for peer in peers:
        if peer.proc.is_alive():
            peer.kill()
    for engine in engines:
        engine.side.close()


def stored_bytes(engine: Engine, keys: list[bytes]) -> int:
    """Bytes of ``engine``'s CPU pool that its chunks under ``keys`` (storage keys) take."""
    total, align = 0, engine.side.store._align
    for key in keys:
        buffer = engine.side.store.get(key)
        assert buffer is not None
        total += -(-buffer.data.numel() // align) * align
        buffer.release()
    return total


def test_a_producer_rank_killed_while_a_smaller_consumer_gathers(ranks):
    """P at TP=2, D at TP=1: D gathers each chunk's two pieces. P's rank 1 dies after sealing the
    first chunk: D loads that chunk (both pieces came), recomputes the rest (rank 0's pieces of them
    came alone: let go of, not kept), and P's rank 0 gives back everything once D is done with it."""
    p0, p1 = ranks("p0", 1, (0, 2)), ranks("p1", 1, (1, 2), in_process=False)
    d = ranks("d", 2, (0, 1), produce=False)
    keys, _ = prompt_keys(PROMPT)
    publish(p0, PROMPT, P_BLOCKS, "t1")
    p1.ask("publish_part", keys[:1], P_BLOCKS[:FIRST], "t1")  # its first chunk sealed, the rest coming
    used_before = d.side.store.cpu_bytes_used()
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", (p0.endpoint, p1.endpoint), wait=True),))
    first = piece_keys(d.side.transfers.layout, keys[0], ((0, 1), (1, 2)))
    wait_for(lambda: all(d.side.store.contains(k) is not None for k in first))  # both pieces came, kept
    p1_first = p1.ask("blocks", P_BLOCKS[:FIRST])
    p1.kill()
    start = time.monotonic()
    assert d.wait_loaded("d-req") == set(D_BLOCKS[FIRST:])  # recomputed from the second chunk on
    assert time.monotonic() - start < 5 * TIMEOUT_MS / 1000
    assert torch.equal(d.blocks(D_BLOCKS[:FIRST]), torch.cat([p0.blocks(P_BLOCKS[:FIRST]), p1_first], dim=2))
    kept = stored_bytes(d, first)  # the first chunk's pieces; rank 0's pieces of the others are let go
    wait_for(lambda: d.side.store.cpu_bytes_used() - used_before == kept, SETTLE_S)
    server = p0.side.chunk_server
    wait_for(lambda: (server.lent_chunks, server.sending_chunks, p0.side.holds.pinned_bytes()) == (0, 0, 0),
             SETTLE_S)


def test_a_consumer_rank_killed_while_a_smaller_producer_cuts_for_it(ranks, transport):
    """P at TP=1, D at TP=2: P cuts each D rank's head out of its chunks. D's rank 1 dies after its
    first chunk, never to release the transfer: D's rank 0 still loads every chunk, and P gives
    back every pin, loan and cut buffer (its CPU pool holds its stored chunks and nothing else).
    Over NIXL the D ranks push (they asked first): P WRITEs the cuts into their buffers, and its
    WRITEs of the rest into the dead rank's fail or run out their deadline."""
    p = ranks("p", 1, (0, 1), pd_hold_s=2)
    d1, d0 = ranks("d1", 2, (1, 2), in_process=False, produce=False), ranks("d0", 2, (0, 2), produce=False)
    keys, tail = prompt_keys(PROMPT)
    p.side.save((SaveJob("p", tuple(keys[:1]), tuple(P_BLOCKS[:FIRST]), publish="t1"),))
    p.side.transfers.drain()
    server = p.side.chunk_server
    d1.ask("fetch", "d-req", PROMPT, D_BLOCKS, "t1", (p.endpoint,), True)
    head1 = p.blocks(P_BLOCKS[:FIRST])[:, :, 1:]
    wait_for(lambda: torch.equal(d1.ask("blocks", D_BLOCKS[:FIRST]), head1))  # rank 1 has its head of chunk 0
    assert server.cut_total == 1
    d1.kill()  # no Release will ever come from it
    publish(p, PROMPT, P_BLOCKS, "t1")
    p.side.transfers.drain()
    d0.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", (p.endpoint,), wait=True),))
    assert d0.wait_loaded("d-req") == set()
    assert torch.equal(d0.blocks(D_BLOCKS), p.blocks(P_BLOCKS)[:, :, :1])
    stored = stored_bytes(p, [p.side.transfers.skey(k) for k in keys + [tail]])
    wait_for(lambda: (server.lent_chunks, server.sending_chunks, p.side.holds.pinned_bytes(),
                      p.side.store.cpu_bytes_used()) == (0, 0, 0, stored), SETTLE_S)
    if transport == "nixl":
        assert server.written_total >= 1 and server.writes_failed_total + server.writes_abandoned_total >= 1


def test_a_consumer_killed_while_it_gathers_leaves_nothing_held_on_either_producer_rank(ranks):
    """P at TP=2, D at TP=1: D dies after the first chunk's pieces came from both of P's ranks, the
    rest still coming. Each P rank gives back every pin and loan of the transfer."""
    p = [ranks(f"p{r}", 1, (r, 2), pd_hold_s=2) for r in range(2)]
    d = ranks("d", 2, (0, 1), in_process=False, produce=False)
    keys, _ = prompt_keys(PROMPT)
    for rank in p:
        rank.side.save((SaveJob("p", tuple(keys[:1]), tuple(P_BLOCKS[:FIRST]), publish="t1"),))
        rank.side.transfers.drain()
    d.ask("fetch", "d-req", PROMPT, D_BLOCKS, "t1", tuple(rank.endpoint for rank in p), True)
    both = torch.cat([rank.blocks(P_BLOCKS[:FIRST]) for rank in p], dim=2)
    wait_for(lambda: torch.equal(d.ask("blocks", D_BLOCKS[:FIRST]), both))  # chunk 0 gathered and scattered
    d.kill()
    for rank in p:
        server = rank.side.chunk_server
        wait_for(lambda: (server.lent_chunks, server.sending_chunks, rank.side.holds.pinned_bytes()) == (0, 0, 0),
                 SETTLE_S)
        publish(rank, PROMPT, P_BLOCKS, "t2")  # and it serves the next consumer
    d2 = ranks("d2", 3, (0, 1), produce=False)
    d2.side.start_loads((remote_job("d2-req", PROMPT, D_BLOCKS, "t2", tuple(rank.endpoint for rank in p)),))
    assert d2.wait_loaded("d2-req") == set()
    assert torch.equal(d2.blocks(D_BLOCKS), torch.cat([rank.blocks(P_BLOCKS) for rank in p], dim=2))


def test_a_producer_killed_while_it_cuts_for_a_larger_consumer(ranks):
    """P at TP=1, D at TP=2: P dies after sealing the first chunk. Each D rank loads its head of
    that chunk, recomputes the rest within the timeout, and keeps only its first chunk."""
    p = ranks("p", 1, (0, 1), in_process=False)
    d = [ranks(f"d{r}", 2, (r, 2), produce=False) for r in range(2)]
    keys, _ = prompt_keys(PROMPT)
    p.ask("publish_part", keys[:1], P_BLOCKS[:FIRST], "t1")
    used_before = [rank.side.store.cpu_bytes_used() for rank in d]
    for rank in d:
        rank.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", (p.endpoint,), wait=True),))
    first = [rank.side.transfers.skey(keys[0]) for rank in d]
    wait_for(lambda: all(rank.side.store.contains(k) is not None for rank, k in zip(d, first)))
    p_first = p.ask("blocks", P_BLOCKS[:FIRST])
    p.kill()
    start = time.monotonic()
    for r, rank in enumerate(d):
        assert rank.wait_loaded("d-req") == set(D_BLOCKS[FIRST:])
        assert torch.equal(rank.blocks(D_BLOCKS[:FIRST]), p_first[:, :, r : r + 1])
    assert time.monotonic() - start < 5 * TIMEOUT_MS / 1000
    for rank, key, before in zip(d, first, used_before):
        kept = stored_bytes(rank, [key])
        wait_for(lambda: rank.side.store.cpu_bytes_used() - before == kept, SETTLE_S)
