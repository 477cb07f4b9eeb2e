"""A peer killed with SIGKILL in the middle of a transfer, on both transports: the engine that
survives recomputes what did not arrive within the timeout, gets the rest byte for byte, and
leaks nothing (no pinned chunk, no lent buffer, no CPU-tier buffer).

The dying engine is a worker half in a process of its own (:mod:`pd_proc`); the survivor runs in
the test's process. Push transfers (D asks before P has sealed everything) make the moment of the
kill certain: some chunks have been moved, the rest are still awaited.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from kvtier.jobs import SaveJob
from pd_proc import engine_main
from pd_workers import prompt_keys, publish, remote_job, tokens_of

PROMPT = tokens_of(100)  # three full chunks and a 4-token tail: 7 blocks
P_BLOCKS = list(range(10, 17))
D_BLOCKS = list(range(40, 47))
TIMEOUT_MS = 1000


class Peer:
    """An engine in its own process."""

    def __init__(self, tmp_path, name: str, seed: int, **config):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(child, tmp_path, name, seed, config), daemon=True)
        self.proc.start()
        assert self.conn.poll(120), f"{name} did not start"
        self.endpoint = self.conn.recv()

    def ask(self, *cmd):
        self.conn.send(cmd)
        assert self.conn.poll(60), f"no answer to {cmd[0]}"
        return self.conn.recv()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


@pytest.fixture
def peers(tmp_path):
    made: list[Peer] = []

    def start(name: str, seed: int, **config) -> Peer:
        made.append(Peer(tmp_path, name, seed, **config))
        return made[-1]

    yield start
    for peer in made:
        if peer.proc.is_alive():
            peer.kill()


def test_producer_killed_mid_transfer_costs_only_what_had_not_arrived(peers, engines, transport):
    p = peers("p", 1, pd_timeout_ms=TIMEOUT_MS, pd_transport=transport)
    d = engines("d", 2, pd_timeout_ms=TIMEOUT_MS)
    full, _ = prompt_keys(PROMPT)
    p.ask("publish_part", full[:1], P_BLOCKS[:2], "t1")  # the first chunk is sealed, the rest is coming
    used_before = d.side.store.cpu_bytes_used()
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    deadline = time.monotonic() + 10
    while d.side.store.contains(d.side.transfers.skey(full[0])) is None and time.monotonic() < deadline:
        time.sleep(0.005)  # D received, verified and kept the first chunk: the rest is awaited
    assert d.side.store.contains(d.side.transfers.skey(full[0])) is not None
    p_first = p.ask("blocks", P_BLOCKS[:2])
    p.kill()
    start = time.monotonic()
    assert d.wait_loaded("d-req") == set(D_BLOCKS[2:])  # recomputed from the second chunk on
    assert time.monotonic() - start < 5 * TIMEOUT_MS / 1000
    assert torch.equal(d.blocks(D_BLOCKS[:2]), p_first)
    align = d.side.store._align
    kept = -(-d.side.transfers.chunk_bytes // align) * align  # the first chunk, kept in D's CPU tier
    # NIXL push: buffers named to P for chunks it never answered stay out of use for 3 timeouts
    # (P might still write there), then go back
    deadline = time.monotonic() + 3 * TIMEOUT_MS / 1000 + 5
    while d.side.store.cpu_bytes_used() - used_before != kept and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.side.store.cpu_bytes_used() - used_before == kept


def test_consumer_killed_mid_transfer_gives_back_every_pin_and_loan(peers, engines, transport):
    p = engines("p", 1, pd_timeout_ms=TIMEOUT_MS, pd_hold_s=2)
    d = peers("d", 2, pd_timeout_ms=TIMEOUT_MS, pd_transport=transport, produce=False)
    full, _ = prompt_keys(PROMPT)
    p.side.save((SaveJob("p", tuple(full[:2]), tuple(P_BLOCKS[:4]), publish="t1"),))  # two chunks sealed
    p.side.transfers.drain()
    d.ask("fetch", "d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, False)  # pull: the rest is "coming"
    server = p.side.chunk_server
    lent = 2 if transport == "nixl" else 0  # NIXL: D READs them from P's pool
    deadline = time.monotonic() + 10
    # a chunk counts as served just before its loan is recorded, on the server's thread
    while (server.served_total < 2 or server.lent_chunks < lent) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert server.lent_chunks == lent
    d.kill()  # no Release will ever come
    deadline = time.monotonic() + 10
    while (server.lent_chunks or p.side.holds.pinned_bytes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.lent_chunks == 0 and p.side.holds.pinned_bytes() == 0
    # P still serves the next consumer
    d2 = engines("d2", 3, pd_timeout_ms=TIMEOUT_MS)
    publish(p, PROMPT, P_BLOCKS, "t2")
    d2.side.start_loads((remote_job("d2-req", PROMPT, D_BLOCKS, "t2", p.endpoint),))
    assert d2.wait_loaded("d2-req") == set()
    assert torch.equal(d2.blocks(D_BLOCKS), p.blocks(P_BLOCKS))


@pytest.mark.parametrize("transport", ["nixl"])  # pushing into engine blocks is NIXL's
@pytest.mark.parametrize("push", ["read", "write"])
def test_consumer_killed_while_the_producer_writes_into_its_blocks_leaves_nothing_held(peers, engines, transport, push):
    from kvtier.jobs import Lend

    p = engines("p", 1, pd_timeout_ms=TIMEOUT_MS)
    d = peers("d", 2, pd_timeout_ms=TIMEOUT_MS, pd_transport=transport, produce=False, pd_hbm_push=push)
    full, tail = prompt_keys(PROMPT)
    d.ask("fetch", "d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, True)  # push: D names its blocks first
    server = p.side.chunk_server
    p.side.save((SaveJob("p-req", tuple(full[:1]), tuple(P_BLOCKS[:2]), publish="t1", lease=True),))
    deadline = time.monotonic() + 10
    copied = (lambda: server.hbm_total) if push == "read" else (lambda: server.blocks_written_total)
    while copied() < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert copied() == 1  # P wrote chunk 0 into D's engine blocks, or D was given them to READ
    d.kill()  # the rest of P's WRITEs have nowhere to go, and no release will come
    p.side.save((SaveJob("p-req", (*full[1:], tail), tuple(P_BLOCKS[2:]), publish="t1", final=True, lease=True),))
    p.side.lend((Lend("p-req", "t1", tuple(P_BLOCKS), tuple(full + [tail]), 500),))  # the request ends
    deadline = time.monotonic() + 10
    while "p-req" not in p.side.finished_sends(set()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.side.engine_kv.held_bytes == 0  # the lease ended: 500 ms, then the grace of one timeout
    assert p.side.engine_kv.leases.stats.abandoned == 1
    # P still serves the next consumer, HBM to HBM
    d2, before = engines("d2", 3, pd_timeout_ms=TIMEOUT_MS, pd_hbm_push=push), copied()
    p.side.save((SaveJob("p2", (*full, tail), tuple(P_BLOCKS), publish="t2", final=True, lease=True),))
    d2.side.start_loads((remote_job("d2-req", PROMPT, D_BLOCKS, "t2", p.endpoint, wait=True),))
    assert d2.wait_loaded("d2-req") == set()
    assert torch.equal(d2.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    assert copied() == before + 4  # the four chunks of t2 copied into d2's blocks (D's fetches were answered too)
