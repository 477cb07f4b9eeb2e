"""P/D push into the consumer's engine blocks (HBM to HBM on a GPU) through the real worker halves
and real NIXL over UCX on loopback. The engine KV here is host memory, registered with NIXL as
DRAM: it stands in for VRAM, and every step of the protocol and every check is the one a GPU
pair runs.

The consumer (D) asks first; the moment the step that computed a chunk is saved, while the request
still runs, the producer (P) answers with the chunk's blocks and D READs them (``pd_hbm_push``
"read"), or D named its engine blocks and P WRITEs the chunk there ("write"). A block that
changed before the copy, a WRITE NIXL refuses, a producer that dies and a consumer that gives up
with chunks to come each end in a recompute or the CPU-tier copy, and nothing is held."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from pd_workers import CHUNK, Engine, advertise_shifted_regions, prompt_keys, remote_job, tokens_of, wait_for
from kvtier.jobs import Lend, SaveJob
from kvtier import timeline
from kvtier.pd import nixl
from kvtier.pd.producer import server as chunk_server
from kvtier.pd.nixl_hold import Hold

PROMPT = tokens_of(100)  # three full chunks and a 4-token tail: 7 blocks
P_BLOCKS = [10, 11, 12, 13, 20, 21, 22]
D_BLOCKS = list(range(40, 47))
FULL, TAIL = prompt_keys(PROMPT)

pytestmark = pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed: make test installs nixl-cu12")


@pytest.fixture
def transport() -> str:
    return "nixl"


def copied(p: Engine, push: str) -> int:
    """Chunks P answered from its engine blocks: READ by D, or WRITTEN into D's."""
    server = p.side.chunk_server
    return server.hbm_total if push == "read" else server.blocks_written_total


def step(p: Engine, first: int, last: int, final: bool = False) -> None:
    """P's step that computed chunks ``first`` … ``last - 1`` of the prompt (the tail with ``final``)."""
    keys = FULL[first:last] + ([TAIL] if final else [])
    blocks = P_BLOCKS[2 * first: len(P_BLOCKS) if final else 2 * last]
    p.side.save((SaveJob("p-req", tuple(keys), tuple(blocks), publish="t1", final=final, lease=True),))


def finish(p: Engine) -> None:
    """P's scheduler half when the request ends: keep its blocks under a lease."""
    p.side.lend((Lend("p-req", "t1", tuple(P_BLOCKS), tuple(FULL + [TAIL]), 2000),))


def test_each_chunk_goes_into_the_consumers_blocks_while_the_producer_computes(engines, caplog, push):
    caplog.set_level(logging.DEBUG, logger="kvtier")  # and marks each WRITE's end (kvtier.timeline)
    p, d = engines("p", 1), engines("d", 2, pd_hbm_push=push)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    server = p.side.chunk_server
    step(p, 0, 2)
    wait_for(lambda: copied(p, push) == 2)  # the request still runs: its own blocks
    wait_for(lambda: torch.equal(d.blocks(D_BLOCKS[:4]), p.blocks(P_BLOCKS[:4])))  # READ: D's turn may be later
    assert not server.pushing or push == "write"  # a producer read from never holds its saves for it
    step(p, 2, 3, final=True)
    assert d.wait_loaded("d-req") == set()
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    expected = (4, 0, 0) if push == "write" else (0, 4, 0)
    assert (server.blocks_written_total, server.hbm_total, server.lent_total) == expected
    assert d.side.transfers.stats.landed_bytes == len(D_BLOCKS) * d.side.transfers.layout.bytes_per_block
    marks, _ = timeline.read(r.getMessage() for r in caplog.records if r.name == "kvtier.timeline")
    if push == "read":  # D's metadata and engine KV never went to P
        assert d.side.chunk_server.nixl.name not in server.nixl.peer_names
        assert "lent" in marks["t1"] and marks["t1"]["lent"] <= marks["d-req"]["load ended"]
    else:
        assert "written" in marks["t1"] and marks["t1"]["written"] <= marks["d-req"]["load ended"]
    start = time.monotonic()
    finish(p)  # D released the transfer before P's request ended: no lease needed
    wait_for(lambda: "p-req" in p.side.finished_sends(set()))
    assert time.monotonic() - start < 1.0 and p.side.engine_kv.held_bytes == 0


def test_each_step_of_many_chunks_lands_by_one_read(engines, monkeypatch):
    """P answers the chunks a step computed in one turn of its server, each reply saying how many
    follow: D READs them as one (posting a READ maps P's KV). Taking the replies at hand, 16 at
    most a READ, cost a 32k prompt's last step four READs after P's prefill."""
    tokens = tokens_of(28 * CHUNK, seed=5)
    keys, ids = prompt_keys(tokens)[0], list(range(56))  # 28 chunks, no tail
    p, d = engines("p", 1), engines("d", 2)
    reads, read = [], d.side.nixl.read
    monkeypatch.setattr(d.side.nixl, "read", lambda *a, **k: reads.append(sum(n for _, n in a[1])) or read(*a, **k))
    hbm = p.side.chunk_server._hbm  # replies trickle out, as from a P whose engine thread holds the GIL
    monkeypatch.setattr(hbm, "_send", lambda *a, send=hbm._send, **k: time.sleep(0.003) or send(*a, **k))
    d.side.start_loads((remote_job("d-req", tokens, ids, "t1", p.endpoint, wait=True),))
    wait_for(lambda: len(p.side.chunk_server._waiting) == 28)  # D asked for every chunk
    for first, last in ((0, 20), (20, 28)):  # P's steps
        p.side.save((SaveJob("p-req", tuple(keys[first:last]), tuple(ids[2 * first: 2 * last]), publish="t1",
                             final=last == 28, lease=True),))
        wait_for(lambda: p.side.chunk_server.hbm_total == last)
    assert d.wait_loaded("d-req") == set()
    assert torch.equal(d.blocks(ids), p.blocks(ids))
    assert len(reads) == 2 and reads[0] * 8 == reads[1] * 20, reads  # one per step (by the chunk at hand: 1, 27)


def test_a_request_that_ends_before_the_consumer_releases_keeps_its_blocks_until_then(engines, push):
    p, d = engines("p", 1), engines("d", 2, pd_hbm_push=push)
    step(p, 0, 3, final=True)
    finish(p)  # the request ended first: the lease keeps its blocks
    assert p.side.engine_kv.held_bytes == len(P_BLOCKS) * p.side.transfers.layout.bytes_per_block
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    assert d.wait_loaded("d-req") == set()
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    assert copied(p, push) == 4
    wait_for(lambda: "p-req" in p.side.finished_sends(set()))
    assert p.side.engine_kv.held_bytes == 0 and p.side.engine_kv.leases.stats.released == 1


def test_a_block_that_changed_before_the_copy_takes_that_chunk_and_those_after_from_the_cpu_tier(engines, caplog,
                                                                                                  push):
    p, d = engines("p", 1), engines("d", 2, pd_hbm_push=push)
    step(p, 0, 3, final=True)
    assert p.side.settle()  # the CPU-tier copies (and their KVSUM64s) are sealed first
    computed = p.blocks(P_BLOCKS)
    p.kv[:, P_BLOCKS[3]] += 1.0  # chunk 1's second block: what a torn or misdirected WRITE looks like
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
        assert d.wait_loaded("d-req") == set()  # nothing recomputed
    assert torch.equal(d.blocks(D_BLOCKS), computed)
    assert "another KVSUM64" in caplog.text


def test_a_write_nixl_refuses_sends_the_cpu_tier_copy_at_once(engines, monkeypatch):
    """D's second hello names engine KV regions outside what it registered: NIXL refuses P's WRITE."""
    p, d = engines("p", 1), engines("d", 2, pd_timeout_ms=20000, pd_hbm_push="write")
    advertise_shifted_regions(d, monkeypatch)
    step(p, 0, 3, final=True)
    assert p.side.settle()
    expected = p.blocks(P_BLOCKS)
    p.kv[:, P_BLOCKS] = 0.0  # had a WRITE run, D would hold zeros
    start = time.monotonic()
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    assert d.wait_loaded("d-req", timeout_s=30) == set()
    assert time.monotonic() - start < 10  # not D's 20 s timeout (vLLM #50754)
    assert torch.equal(d.blocks(D_BLOCKS), expected)
    server = p.side.chunk_server
    assert (server.writes_failed_total, server.blocks_written_total) == (4, 0)
    assert not server._writes.busy("t1") and not server._writes


def test_a_consumer_that_gives_up_is_never_written_into_afterwards(engines, push):
    p, d = engines("p", 1, pd_timeout_ms=60000), engines("d", 2, pd_timeout_ms=60000, pd_hbm_push=push)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    step(p, 0, 1)
    wait_for(lambda: copied(p, push) == 1)
    d.side.start_loads((), cancels=("d-req",))  # vLLM aborted it: D keeps chunk 0, recomputes the rest
    failed = d.wait_loaded("d-req", timeout_s=30)  # chunk 0 too if P's word on it came after the abort (a busy box)
    assert failed in (set(D_BLOCKS[2:]), set(D_BLOCKS)), failed
    before = d.blocks(D_BLOCKS[2:])
    step(p, 1, 3, final=True)  # P goes on computing
    assert p.side.settle()
    time.sleep(0.2)  # a turn of P's chunk server, had a fetch of D's been left waiting
    assert copied(p, push) == 1
    assert torch.equal(d.blocks(D_BLOCKS[2:]), before)


def test_a_producer_killed_mid_transfer_costs_one_timeout_and_keeps_what_landed(engines, push, monkeypatch):
    p, d = engines("p", 1), engines("d", 2, pd_hbm_push=push)  # pd_timeout_ms=1000
    reads, read = [], d.side.nixl.read
    monkeypatch.setattr(d.side.nixl, "read", lambda *a, **k: reads.append(t := read(*a, **k)) or t)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    step(p, 0, 1)
    wait_for(lambda: copied(p, push) == 1)
    if push == "read":  # its end needs P's progress (UCX's host transports): P must still run then
        wait_for(lambda: reads and reads[0].state() == "DONE")
    start = time.monotonic()
    p.side.chunk_server.close()  # P dies before computing the rest: no heartbeat, no answer to a release
    failed = d.wait_loaded("d-req")
    assert time.monotonic() - start < 1.9  # one timeout, not a second one waiting for P's word
    assert failed == set(D_BLOCKS[2:])
    assert torch.equal(d.blocks(D_BLOCKS[:2]), p.blocks(P_BLOCKS[:2]))


def test_a_producer_killed_while_its_block_read_runs_fails_that_chunk_once_its_agent_is_dropped(engines, caplog):
    """Over UCX's host transports (not cuda_ipc) a first READ of P's memory needs P's progress,
    which stops with P's chunk server: the READ runs on (held here until P's agent is dropped).
    D's watch of P's chunk server drops P's agent as it goes, NIXL fails the READ then, and the
    load reports chunk 0 failed too, before the READ's deadline."""
    p, d = engines("p", 1), engines("d", 2, pd_hbm_push="read")  # pd_timeout_ms=1000
    kv = (d.kv.data_ptr(), d.kv.data_ptr() + d.kv.numel() * d.kv.element_size())
    with Hold(lambda op, peer, local: op == "READ" and kv[0] <= local[0][0] < kv[1], teardown=True) as hold:
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
        step(p, 0, 1)
        wait_for(lambda: hold.transfers)  # D READs chunk 0 from P's blocks
        start = time.monotonic()
        p.side.chunk_server.close()
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            assert d.wait_loaded("d-req") == set(D_BLOCKS)
    assert time.monotonic() - start < 1.0  # before the READ's deadline
    assert p.side.nixl.name not in d.side.nixl.peer_names and hold.transfers[0].state() == "ERR"
    assert not [r for r in caplog.records if r.name == "kvtier.pd.consumer.fence"]  # it ended: nothing fenced


def test_a_consumer_written_into_is_forgotten_once_idle_and_reached_again_for_the_next_transfer(engines, monkeypatch):
    """NIXL keeps what it imported of a known peer's memory (on vLLM 0.33 a stopped D's whole KV
    cache stayed held on its GPU while P knew D): P drops D's agent once no transfer used it. D
    keeps P's while P's chunk server is up (kvtier.pd.consumer.peer_watch drops it when P goes)."""
    monkeypatch.setattr(chunk_server, "PEER_IDLE_S", 0.2)
    p, d = engines("p", 1), engines("d", 2, pd_hbm_push="write")
    agent, theirs = p.side.chunk_server.nixl, d.side.chunk_server.nixl.name
    d_agent = d.side.chunk_server.nixl
    for transfer in ("t1", "t2"):
        d.side.start_loads((remote_job(f"d-{transfer}", PROMPT, D_BLOCKS, transfer, p.endpoint, wait=True),))
        p.side.save((SaveJob(f"p-{transfer}", tuple(FULL + [TAIL]), tuple(P_BLOCKS), publish=transfer, final=True,
                             lease=True),))
        assert d.wait_loaded(f"d-{transfer}") == set()
        assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS)) and theirs in agent.peer_names
        p.side.lend((Lend(f"p-{transfer}", transfer, tuple(P_BLOCKS), tuple(FULL + [TAIL]), 2000),))
        wait_for(lambda: theirs not in agent.peer_names)  # released, then unused for PEER_IDLE_S
        assert agent.name in d_agent.peer_names
        d.kv[:, D_BLOCKS] = 0.0
    assert p.side.chunk_server.blocks_written_total == 8  # both transfers HBM to HBM


def test_a_producer_queues_more_replies_than_a_push_consumer_has_fetches_in_flight():
    """A reply dropped at the queue's limit would leave D waiting for its timeout."""
    from kvtier.pd import route
    from kvtier.pd.producer import server

    assert server._SEND_HWM >= 2 * route.PUSH_WINDOW
