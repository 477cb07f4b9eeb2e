"""P/D HBM to HBM before the producer's CPU-tier copy is stored: the producer (P) takes each
published chunk's KVSUM64 from its engine blocks as the step that computed it ends
(:mod:`kvtier.pd.producer.sums`), and WRITEs it (push, ``pd_hbm_push`` "write") or lends it (pull, and push
"read") at once, without waiting
for its save to land. Real worker halves, real NIXL over UCX on loopback; the engine KV is host
memory registered as DRAM, standing in for VRAM. P's save thread is held at its store (the
stand-in for a CPU-tier copy still crossing PCIe) so that nothing is stored while D loads."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from pd_workers import Engine, advertise_shifted_regions, remote_job
from test_pd_hbm_push import D_BLOCKS, FULL, P_BLOCKS, PROMPT, TAIL, copied, finish, step, wait_for
from kvtier import codec
from kvtier.jobs import SaveJob
from kvtier.pd import nixl
from kvtier.transfer import remote

pytestmark = pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed: make test installs nixl-cu12")


@pytest.fixture
def transport() -> str:
    return "nixl"


@pytest.fixture
def held_store(monkeypatch):
    """``hold(engine)``: that engine's save thread waits at its store until the returned event is set."""
    gates = []

    def hold(engine: Engine) -> threading.Event:
        gate = threading.Event()
        gates.append(gate)
        put = engine.side.store.put
        monkeypatch.setattr(engine.side.store, "put", lambda *a, **k: (gate.wait(30), put(*a, **k))[1])
        return gate

    yield hold
    for gate in gates:
        gate.set()  # a save thread still held must not outlive the test's engines


def misreport_chunk_1(p: Engine, monkeypatch) -> None:
    """P's KVSUM64 of chunk 1 is off by a bit: its blocks are not what P summed (as a block reused
    or torn between its step and its copy into D)."""
    sums = p.side.engine_kv.sums
    get = sums.get
    monkeypatch.setattr(sums, "get", lambda t, key, n: get(t, key, n) if key != FULL[1] or get(t, key, n) is None
                        else get(t, key, n) ^ 1)


def stored(engine: Engine) -> int:
    return len(engine.side.store.keys())


def test_push_copies_each_chunk_before_its_cpu_tier_copy_is_stored(engines, held_store, push):
    p, d = engines("p", 1), engines("d", 2, pd_hbm_push=push)
    gate = held_store(p)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    step(p, 0, 2)
    wait_for(lambda: copied(p, push) == 2)
    step(p, 2, 3, final=True)
    assert d.wait_loaded("d-req") == set()
    assert stored(p) == 0  # every chunk went out before any was stored
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS)) and copied(p, push) == 4
    gate.set()
    assert p.side.settle()
    sums = p.side.engine_kv.sums
    for key, n in [(k, 2) for k in FULL] + [(TAIL, 1)]:  # the same KVSUM64 as the save's copy
        copy = p.side.store.get(p.side.transfers.skey(key))
        assert codec.read_header(copy.data).checksum == sums.get("t1", key, n)
        copy.release()
    finish(p)


def test_pull_lends_the_blocks_of_a_finished_request_before_its_copy_is_stored(engines, held_store):
    p, d = engines("p", 1), engines("d", 2)
    held_store(p)
    step(p, 0, 3, final=True)
    finish(p)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set()
    assert stored(p) == 0
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS)) and p.side.chunk_server.hbm_total == 4


def test_a_chunk_whose_save_was_lost_still_goes_from_its_blocks(engines, monkeypatch):
    """P's CPU tier had no room for the request's chunks (every save given up): under the lease
    its blocks and their checksums still serve the decode engine, which recomputes nothing."""
    p, d = engines("p", 1), engines("d", 2)
    monkeypatch.setattr(p.side.store, "allocate", lambda *a, **k: None)
    step(p, 0, 3, final=True)
    finish(p)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set()
    assert stored(p) == 0 and p.side.chunk_server.hbm_total == 4
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))


def test_a_block_that_changed_after_its_step_fails_its_chunk_and_those_after(engines, held_store, caplog):
    """The checksum is of the blocks as the step left them: a block changed before D reads it
    (reused, torn) is caught on D, before the request runs."""
    p, d = engines("p", 1), engines("d", 2)
    held_store(p)
    step(p, 0, 3, final=True)
    p.kv[:, P_BLOCKS[3]] += 1.0  # chunk 1's second block
    finish(p)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set(D_BLOCKS[2:])  # vLLM recomputes from chunk 1 on
    assert "another KVSUM64" in caplog.text


def test_a_failed_write_before_the_copy_is_stored_sends_that_copy_once_stored(engines, held_store, monkeypatch):
    """D's second hello names engine KV regions outside what it registered: NIXL refuses P's WRITE."""
    p, d = engines("p", 1), engines("d", 2, pd_timeout_ms=20000, pd_hbm_push="write")
    advertise_shifted_regions(d, monkeypatch)
    gate = held_store(p)
    server = p.side.chunk_server
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    step(p, 0, 3, final=True)
    wait_for(lambda: server.writes_failed_total == 4)  # each chunk waits for its copy now
    assert "d-req" not in d.side.finished_loads()
    expected = p.blocks(P_BLOCKS)
    gate.set()
    assert d.wait_loaded("d-req", timeout_s=30) == set()  # not a recompute: the CPU-tier copies
    assert torch.equal(d.blocks(D_BLOCKS), expected) and server.blocks_written_total == 0
    assert not server._writes.busy("t1")
    finish(p)


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "chunk-1-changed"])
def test_a_push_consumer_checks_its_chunks_as_they_land(engines, held_store, monkeypatch, caplog, corrupt):
    """Batches of ``CHECK_AT`` chunks are checked while P still computes, so only the last batch's
    check is left once the last READ lands; a bad chunk in an early batch ends the transfer there."""
    monkeypatch.setattr(remote, "CHECK_AT", 2)
    caplog.set_level(logging.DEBUG, logger="kvtier")
    p, d = engines("p", 1), engines("d", 2)
    gate = held_store(p)
    if corrupt:
        misreport_chunk_1(p, monkeypatch)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    step(p, 0, 2)
    wait_for(lambda: torch.equal(d.blocks(D_BLOCKS[:4]), p.blocks(P_BLOCKS[:4])))  # P's next step after D's READ
    step(p, 2, 3, final=True)
    if corrupt:
        gate.set()  # chunk 1 and those after come again from P's CPU tier, which now stores them
    failed = d.wait_loaded("d-req")
    checks = [r.getMessage() for r in caplog.records if "chunks landed, checked in" in r.getMessage()]
    if corrupt:
        assert len(checks) == 1  # the first batch ended the landing
        # P's stored copy of chunk 1 (its save summed what it copied: loaded), or, before the save
        # copied it, P's blocks with the same bad sum (recomputed from chunk 1): never the bad landing.
        assert failed in (set(D_BLOCKS[2:]), set())
        kept = len(D_BLOCKS) - len(failed)
        assert torch.equal(d.blocks(D_BLOCKS[:kept]), p.blocks(P_BLOCKS[:kept]))
    else:
        assert failed == set() and [c.split()[2] for c in checks] == ["2", "2"]
        assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    finish(p)


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "chunk-1-changed"])
def test_a_push_consumer_checks_the_chunks_of_one_step_in_one_pass(engines, held_store, monkeypatch, caplog, push,
                                                                   corrupt):
    """P's one step computed every chunk: they land at once (one READ, or one WRITE of P's) and D
    checks them in one pass, not in batches of ``CHECK_AT`` one after another (each pass has a
    fixed cost on the host); a bad chunk among them fails the blocks from it on."""
    monkeypatch.setattr(remote, "CHECK_AT", 2)
    caplog.set_level(logging.DEBUG, logger="kvtier")
    p, d = engines("p", 1), engines("d", 2, pd_hbm_push=push)
    held_store(p)
    if corrupt:
        misreport_chunk_1(p, monkeypatch)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    if push == "write":  # D's blocks named to P first: P writes a step's chunks as one WRITE
        wait_for(lambda: len(p.side.chunk_server._waiting) == 4)
    step(p, 0, 3, final=True)
    assert d.wait_loaded("d-req") == (set(D_BLOCKS[2:]) if corrupt else set())
    checks = [r.getMessage() for r in caplog.records if "chunks landed, checked in" in r.getMessage()]
    landed = [r.getMessage().split("chunks landed by ")[1] for r in caplog.records if "chunks landed by" in r.getMessage()]
    assert landed and landed[-1].startswith("1 READs" if push == "read" else "0 READs")
    assert copied(p, push) == 4 and [c.split()[2] for c in checks] == ["4"]
    if corrupt:
        assert any("chunk 1 of transfer t1" in r.getMessage() and "another KVSUM64" in r.getMessage()
                   for r in caplog.records)
    else:
        assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    finish(p)


def test_a_steps_copy_out_waits_for_its_checksum_pass(engines, monkeypatch):
    """On a GPU the checksum pass's sums reach the host through the copy engines, and queued
    behind the step's copy-out they came when the stored copies did: the copy-out is given the
    pass's event to wait for (the order on a GPU: ``tests/ops/test_gpu_early_sums.py``). Host
    memory here: the pass runs at once, so each copy-out of a published step finds its chunks'
    sums in, and is given what the pass returned (no event); one not published takes no sums."""
    p = engines("p", 1)
    sums, transfers = p.side.engine_kv.sums, p.side.group_transfers[0]
    took, take = [], sums.take
    monkeypatch.setattr(sums, "take", lambda t, keys, ids: (took.append(event := take(t, keys, ids)), event)[1])
    waits, save = [], transfers.save
    monkeypatch.setattr(transfers, "save", lambda jobs, wait_forward=False, after=None: (
        waits.append((after, [sums.get(j.publish, k, len(j.block_ids) // len(j.keys)) is not None
                             for j in jobs for k in j.keys])),
        save(jobs, wait_forward, after))[1])
    step(p, 0, 2)
    p.side.save((SaveJob("other", (FULL[2],), tuple(P_BLOCKS[4:6])),))  # not published: no pass, no wait
    assert took == [None] and waits == [(None, [True, True]), (None, [False])]
    assert p.side.settle()
    for key in FULL[:2]:  # the stored copy's KVSUM64 is the one the pass took
        copy = p.side.store.get(p.side.transfers.skey(key))
        assert codec.read_header(copy.data).checksum == sums.get("t1", key, 2)
        copy.release()
    finish(p)


def test_a_producers_idle_step_waits_for_the_decode_engine_to_release_its_lease(engines):
    """P's loop steps on while a finished request's blocks are lent; such a step waits for D's
    release (or ``idle_wait_us``), the interpreter left to P's chunk server meanwhile."""
    p, d = engines("p", 1), engines("d", 2)
    step(p, 0, 3, final=True)
    finish(p)
    start = time.monotonic()
    p.side.wait_idle(0.05)
    assert time.monotonic() - start >= 0.04  # lent, not released yet: the whole wait
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set()
    start = time.monotonic()
    p.side.wait_idle(10.0)
    assert time.monotonic() - start < 5.0  # D released: no wait, or woken by it
    assert p.side.finished_sends(set()) == {"p-req"}
    start = time.monotonic()
    p.side.wait_idle(5.0)
    assert time.monotonic() - start < 1.0  # nothing lent, nothing loading: no wait


def test_two_transfers_computing_the_same_chunk_keep_their_own_checksums(engines):
    """Regression: keyed by chain key alone, a later batch's sum of the same chunk replaced the
    earlier one's, and the earlier transfer's blocks (another batch: other bytes) failed their check."""
    p = engines("p", 1)
    sums = p.side.engine_kv.sums
    p.kv[:, 30:32] = p.kv[:, 10:12] + 1.0  # the same chunk computed in another batch, not bit for bit
    sums.take("t1", (FULL[0],), (10, 11))
    sums.take("t2", (FULL[0],), (30, 31))
    first, second = sums.get("t1", FULL[0], 2), sums.get("t2", FULL[0], 2)
    assert None not in (first, second) and first != second
    assert sums.get("t3", FULL[0], 2) is None
