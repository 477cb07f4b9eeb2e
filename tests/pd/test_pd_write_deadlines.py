"""A producer's WRITEs into a push consumer's engine blocks that NIXL refuses or that do not end,
through the real worker halves, real ZMQ and real NIXL over UCX on loopback (the engine KV is host
memory registered as DRAM, standing in for VRAM).

(A WRITE NIXL refuses: ``test_pd_hbm_push.py``, ``test_pd_hbm_early.py``.) A WRITE that does not end is held by :class:`kvtier.pd.nixl_hold.Hold`, posted
only when let go (``late``): past its deadline (P's ``pd_timeout_ms``) P abandons it, drops the
consumer's NIXL agent (so when let go NIXL refuses it, and nothing lands), sends its chunks as
payloads, and answers a release that waited for it."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import zmq

from pd_workers import Engine, remote_job, wait_for
from test_pd_hbm_push import D_BLOCKS, P_BLOCKS, PROMPT, finish, step
from kvtier.pd import nixl
from kvtier.pd.consumer.connection import Connection, Consumer, FetchSpec
from kvtier.pd.nixl_hold import Hold
from kvtier.pd.protocol import VERSION, ChunkReply, Hello, Release, encode, mac

pytestmark = pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed: make test installs nixl-cu12")
TIMEOUT_MS = 600  # P's pd_timeout_ms: each WRITE's deadline


@pytest.fixture
def transport() -> str:
    return "nixl"


def writes_into(d: Engine):
    """A :class:`Hold` match: WRITEs into ``d``'s memory."""
    name = d.side.nixl.name
    return lambda op, peer, local: op == "WRITE" and peer == name


def test_a_write_held_past_its_deadline_is_abandoned_and_the_chunks_come_as_payloads(engines, caplog):
    """D waits longer than P's deadline: P abandons the WRITE, drops D's agent and sends the chunks
    from its stored copies; D loads P's bytes, and the WRITE, let go, lands nowhere."""
    p = engines("p", 1, pd_timeout_ms=TIMEOUT_MS)
    d = engines("d", 2, pd_timeout_ms=10_000, pd_hbm_push="write")
    server = p.side.chunk_server
    step(p, 0, 3, final=True)
    assert p.side.settle()
    with Hold(writes_into(d), late=True) as hold, caplog.at_level(logging.WARNING, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
        wait_for(lambda: hold.transfers)
        posted_s = time.monotonic()
        wait_for(lambda: not server._writes.busy("t1"))
        assert time.monotonic() - posted_s < TIMEOUT_MS / 1000 + 0.3  # the deadline, then a turn of P's loop
        assert server.writes_abandoned_total == 4 and d.side.nixl.name not in p.side.nixl.peer_names
        assert d.wait_loaded("d-req") == set()
        assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))  # the stored copies, as payloads
        d.kv[:, D_BLOCKS] = 0.0
        hold.let_go()
        wait_for(lambda: hold.transfers[0].state() != "PROC")
    assert hold.transfers[0].state() == "ERR"  # D's agent was dropped: NIXL refuses it
    assert not d.kv[:, D_BLOCKS].any()
    assert server.blocks_written_total == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvtier.pd.producer.writes"]
    assert len(warnings) == 1 and d.side.nixl.name in warnings[0], warnings


def test_a_release_waiting_for_a_write_past_its_deadline_is_answered(engines, caplog):
    """D gives up (its request is aborted) while P's WRITE into its blocks is held: its release asks
    for P's word that no WRITE still runs. P abandons the WRITE at its deadline and answers; D's
    load reports then, all recomputed (nothing it did not check is reported loaded)."""
    p = engines("p", 1, pd_timeout_ms=TIMEOUT_MS)
    d = engines("d", 2, pd_timeout_ms=TIMEOUT_MS, pd_hbm_push="write")
    server = p.side.chunk_server
    d.kv[:, D_BLOCKS] = 0.0
    with Hold(writes_into(d), late=True) as hold, caplog.at_level(logging.WARNING, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
        wait_for(lambda: len(server._waiting) == 4)  # D named its blocks for every chunk
        step(p, 0, 3, final=True)
        wait_for(lambda: hold.transfers)
        posted_s = time.monotonic()
        d.side.start_loads((), cancels=("d-req",))
        assert d.wait_loaded("d-req") == set(D_BLOCKS)
        reported_s = time.monotonic()
        hold.let_go()
        wait_for(lambda: hold.transfers[0].state() != "PROC")
    assert reported_s - posted_s >= TIMEOUT_MS / 1000 - 0.05  # D waited for P's word
    assert reported_s - posted_s < 2 * TIMEOUT_MS / 1000  # which came at P's deadline, not after D's wait
    assert not any("did not confirm" in r.getMessage() for r in caplog.records)
    assert server.writes_abandoned_total == 4 and not server._writes.busy("t1")
    assert hold.transfers[0].state() == "ERR" and not d.kv[:, D_BLOCKS].any()  # nothing landed
    finish(p)


def test_a_consumer_waits_up_to_twice_its_timeout_for_the_word_that_no_write_runs(caplog):
    """P answers such a release once its last WRITE ended or was abandoned, one deadline after that
    WRITE's posting: later than one timeout after the release. D's half of the contract: it waits
    up to twice the timeout. A producer scripted on a ROUTER socket answers after 1.5 timeouts."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    consumer = Consumer(Hello(VERSION, 0, 1, b"", "", 0), TIMEOUT_MS, None, lambda n: None, lambda n: 0)
    peer = Connection(dealer, consumer, FetchSpec(endpoint, "t1", [], True))
    peer.send(Release(VERSION, "t1", answer=True))
    identity = router.recv_multipart()[0]
    body = encode(ChunkReply(VERSION, -1, "released"))
    answer = threading.Timer(1.5 * TIMEOUT_MS / 1000, lambda: router.send_multipart([identity, mac(None, body), body]))
    start = time.monotonic()
    answer.start()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        peer.settle_writes()
    waited_s = time.monotonic() - start
    answer.join()
    dealer.close()
    router.close()
    assert 1.4 * TIMEOUT_MS / 1000 <= waited_s < 2 * TIMEOUT_MS / 1000
    assert not caplog.records  # P's word came
