"""P/D through the real worker halves: what D loads is byte for byte what P computed, and every
way a producer can fail ends in load errors (recomputed by vLLM) within the timeout, never a
hang or a wrong block."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from pd_workers import BLOCK, CHUNK, prompt_keys, publish, remote_job, tokens_of
from kvtier.jobs import LoadJob, SaveJob

PROMPT = tokens_of(100)  # three full chunks and a 4-token tail: 7 blocks
P_BLOCKS = list(range(10, 17))
D_BLOCKS = list(range(40, 47))


def test_consumer_gets_the_whole_prompt_byte_for_byte_and_keeps_full_chunks(engines, transport):
    p, d = engines("p", 1), engines("d", 2)
    keys = publish(p, PROMPT, P_BLOCKS, "t1")
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set()
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    held = [d.side.store.contains(d.side.transfers.skey(k)) for k in keys]
    assert all(t is not None for t in held[:3]) and held[3] is None  # the next turn reloads locally; no tail
    assert d.side.transfers.stats.remote_hit_tokens == len(D_BLOCKS) * BLOCK
    deadline = time.monotonic() + 5
    while p.side.holds.stats.released == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.side.holds.stats.released == 1 and p.side.holds.pinned_bytes() == 0
    # NIXL: the four chunks (three full and the tail) were lent, READ by D, and all given back
    assert p.side.chunk_server.lent_total == (4 if transport == "nixl" else 0)
    assert p.side.chunk_server.lent_chunks == 0
    while p.side.chunk_server.sending_chunks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.side.chunk_server.sending_chunks == 0  # ZMQ: each buffer given back once D took its chunk


def test_consumer_starting_after_its_own_tiers_fetches_only_the_rest(engines):
    p, d = engines("p", 1), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t1")
    job = remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, start_chunk=1)
    d.side.start_loads((job,))
    assert d.wait_loaded("d-req") == set()
    skip = CHUNK // BLOCK
    assert torch.equal(d.blocks(D_BLOCKS[skip:]), p.blocks(P_BLOCKS[skip:]))
    assert not torch.equal(d.blocks(D_BLOCKS[:skip]), p.blocks(P_BLOCKS[:skip]))


@pytest.mark.parametrize("push", ["read", "write"])
@pytest.mark.parametrize("lease_ms", [2000, 0], ids=["engine-blocks", "cpu-tier"])
def test_push_consumer_first_gets_chunks_as_the_producer_seals_them(engines, transport, lease_ms, push):
    p, d = engines("p", 1, pd_hbm_lease_ms=lease_ms), engines("d", 2, pd_hbm_push=push)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    time.sleep(0.3)  # D is waiting before P computed anything
    full, tail = prompt_keys(PROMPT)
    lease = lease_ms > 0
    p.side.save((SaveJob("p", (), (), publish="t1", lease=lease),))  # P's first step: computing, nothing sealed yet
    time.sleep(0.5)  # longer than half the timeout: heartbeats keep D waiting
    p.side.save((SaveJob("p", tuple(full[:2]), tuple(P_BLOCKS[:4]), publish="t1", lease=lease),))
    time.sleep(0.5)
    p.side.save((SaveJob("p", (full[2], tail), tuple(P_BLOCKS[4:]), publish="t1", final=True, lease=lease),))
    assert d.wait_loaded("d-req") == set()
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    # NIXL: the moment each chunk was sealed, D was given P's engine blocks to READ (with leases,
    # "read"), or P wrote it from them into D's ("write"), or into a buffer of D's CPU tier (no
    # leases); no CPU-tier buffer was lent
    server = p.side.chunk_server
    reads = transport == "nixl" and lease and push == "read"
    assert (server.written_total, server.lent_total) == ((4 - 4 * reads, 0) if transport == "nixl" else (0, 0))
    assert server.blocks_written_total == (4 if transport == "nixl" and lease and not reads else 0)
    assert server.hbm_total == 4 * reads


def test_corrupt_chunk_fails_from_that_chunk_on(engines, caplog):
    p, d = engines("p", 1), engines("d", 2)
    keys = publish(p, PROMPT, P_BLOCKS, "t1")
    p.side.transfers.drain()
    buffer = p.side.store.get(p.side.transfers.skey(keys[1]))
    buffer.data[-1] ^= 0xFF  # one flipped byte in the stored chunk's payload
    buffer.release()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
        failed = d.wait_loaded("d-req")
    assert failed == set(D_BLOCKS[2:])
    assert torch.equal(d.blocks(D_BLOCKS[:2]), p.blocks(P_BLOCKS[:2]))
    assert "checksum mismatch" in caplog.text


def test_unreachable_producer_fails_within_the_timeout(engines):
    d = engines("d", 2, produce=False)
    start = time.monotonic()
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", "tcp://127.0.0.1:9"),))
    assert d.wait_loaded("d-req") == set(D_BLOCKS)
    assert time.monotonic() - start < 10  # pd_timeout_ms=1000: bounded, never a hang


def test_producer_that_never_computes_the_transfer_times_out(engines):
    p, d = engines("p", 1), engines("d", 2)
    start = time.monotonic()
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "never", p.endpoint, wait=True),))
    assert d.wait_loaded("d-req") == set(D_BLOCKS)
    assert time.monotonic() - start < 10  # pd_timeout_ms=1000: bounded, never a hang


def test_chunk_the_producer_no_longer_has_fails_at_once(engines):
    p, d = engines("p", 1), engines("d", 2, pd_timeout_ms=60000)
    start = time.monotonic()
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "gone", p.endpoint),))
    assert d.wait_loaded("d-req", timeout_s=30) == set(D_BLOCKS)
    assert time.monotonic() - start < 30  # answered "missing": no waiting for the 60 s timeout


def test_producer_killed_mid_transfer_keeps_what_arrived(engines):
    p, d = engines("p", 1), engines("d", 2)
    full, _ = prompt_keys(PROMPT)
    p.side.save((SaveJob("p", tuple(full[:1]), tuple(P_BLOCKS[:2]), publish="t1"),))
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    time.sleep(0.3)
    p.side.chunk_server.close()  # the producer dies before the rest of the prompt is computed
    assert d.wait_loaded("d-req") == set(D_BLOCKS[2:])
    assert torch.equal(d.blocks(D_BLOCKS[:2]), p.blocks(P_BLOCKS[:2]))


def test_wrong_secret_is_refused_and_logged(engines, caplog):
    """Another secret derives another key of P's for ZMQ CURVE: D's connection never opens (no
    message of D's reaches P, nothing of P's reaches D); P counts and logs each attempt, and D
    says what it may be before it recomputes."""
    p, d = engines("p", 1, pd_secret="right"), engines("d", 2, pd_secret="wrong")
    publish(p, PROMPT, P_BLOCKS, "t1")
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
        assert d.wait_loaded("d-req") == set(D_BLOCKS)
    assert p.side.chunk_server.rejected >= 1 and p.side.chunk_server.received_total == 0
    assert "failed the encrypted (CURVE) handshake" in caplog.text and "pd_secret may differ" in caplog.text


def test_same_secret_authenticates(engines):
    p, d = engines("p", 1, pd_secret="s3cret"), engines("d", 2, pd_secret="s3cret")
    publish(p, PROMPT, P_BLOCKS, "t1")
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set()
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))


def test_layout_mismatch_is_caught_at_the_handshake_naming_both(engines, caplog):
    p, d = engines("p", 1), engines("d", 2, layers=3)
    publish(p, PROMPT, P_BLOCKS, "t1")
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
        assert d.wait_loaded("d-req") == set(D_BLOCKS)
    line = next(r.getMessage() for r in caplog.records if "layouts differ" in r.getMessage())
    assert "3 regions" in line and "2 regions" in line


def test_tensor_parallel_size_mismatch_is_refused(engines):
    p, d = engines("p", 1), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t1")
    job = remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint)
    job = type(job)(job.req_id, job.keys, 0, job.block_ids, job.tail_blocks,
                    type(job.remote)("t1", (p.endpoint, p.endpoint), 0))
    d.side.start_loads((job,))
    assert d.wait_loaded("d-req") == set(D_BLOCKS)


def test_published_chunks_are_pinned_against_lru_pressure(engines):
    p, d = engines("p", 1, cpu_bytes=256 << 10), engines("d", 2)  # room for 15 chunks of 16 KiB
    publish(p, PROMPT, P_BLOCKS, "t1")
    p.side.transfers.drain()
    first_other = None
    for i in range(8):  # other requests' saves: twice what the pool holds
        others, _ = prompt_keys(tokens_of(CHUNK * 4, seed=100 + i))
        first_other = first_other or others[0]
        p.side.save((SaveJob(f"o{i}", tuple(others), tuple(range(20, 28))),))
        p.side.transfers.drain()
    assert p.side.store.contains(p.side.transfers.skey(first_other)) is None  # the LRU did evict
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set()
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))


def test_unfetched_hold_expires_and_is_counted(engines):
    p = engines("p", 1, pd_hold_s=1)
    publish(p, PROMPT, P_BLOCKS, "t1")
    p.side.transfers.drain()
    assert p.side.holds.pinned_bytes() > 0
    deadline = time.monotonic() + 5
    while p.side.holds.stats.expired == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.side.holds.stats.expired == 1 and p.side.holds.pinned_bytes() == 0


def test_hold_is_bounded_in_bytes_oldest_unpinned_first(engines):
    p = engines("p", 1, pd_hold_bytes=80 << 10)  # one 7-block prompt's chunks (56 KiB), not two
    publish(p, PROMPT, P_BLOCKS, "t1")
    p.side.transfers.drain()
    publish(p, tokens_of(100, seed=5), list(range(30, 37)), "t2")
    p.side.transfers.drain()
    holds = p.side.holds
    assert holds.stats.overflowed == 1 and holds.pinned_bytes() <= 80 << 10
    assert holds.state("t1", b"x" * 16) == "unknown" and holds.state("t2", b"x" * 16) == "ended"


def test_a_waiting_consumer_does_not_delay_a_reload(engines):
    """A push transfer waits for its producer on its own threads; the tier reload runs meanwhile."""
    p, d = engines("p", 1), engines("d", 2, pd_timeout_ms=60000)
    full, _ = prompt_keys(tokens_of(64, seed=9))
    d.side.save((SaveJob("x", tuple(full), tuple(range(0, 4))),))
    d.side.transfers.drain()
    d.side.start_loads((remote_job("slow", PROMPT, D_BLOCKS, "later", p.endpoint, wait=True),))
    started = time.monotonic()
    d.side.start_loads((LoadJob("fast", tuple(full), 0, tuple(range(50, 54))),))
    seen: set[str] = set()
    while "fast" not in seen and time.monotonic() - started < 30:
        seen |= d.side.finished_loads()
        time.sleep(0.005)
    assert "fast" in seen and "slow" not in seen  # the transfer waits up to 60 s; the reload did not
    assert torch.equal(d.blocks(range(50, 54)), d.blocks(range(0, 4)))
    d.side.start_loads((), cancels=("slow",))
    assert d.wait_loaded("slow") == set(D_BLOCKS)


def test_aborted_consumer_stops_waiting_and_reports_at_once(engines):
    p, d = engines("p", 1, pd_timeout_ms=60000), engines("d", 2, pd_timeout_ms=60000)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    p.side.save((SaveJob("p", (), (), publish="t1"),))  # P computes: heartbeats would keep D waiting
    time.sleep(0.3)
    start = time.monotonic()
    d.side.start_loads((), cancels=("d-req",))  # vLLM aborted it; its blocks wait for this report
    assert d.wait_loaded("d-req", timeout_s=30) == set(D_BLOCKS)
    assert time.monotonic() - start < 30  # not the 60 s timeout


def test_push_consumer_keeps_waiting_through_a_prefill_step_longer_than_the_timeout(engines):
    """The producer's worker hears of the request at the start of its step: heartbeats cover a
    forward longer than pd_timeout_ms, before anything of the prompt is sealed."""
    p, d = engines("p", 1), engines("d", 2)  # pd_timeout_ms=1000
    full, tail = prompt_keys(PROMPT)
    job = SaveJob("p", (*full, tail), tuple(P_BLOCKS), publish="t1", final=True)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    p.side.announce((job,))  # start of P's step
    time.sleep(2.5)  # the forward: 2.5 timeouts long
    p.side.save((job,))  # end of the step
    assert d.wait_loaded("d-req") == set()
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))


def test_aborted_producer_request_ends_the_waiting_consumer_at_once(engines):
    p, d = engines("p", 1, pd_timeout_ms=60000), engines("d", 2, pd_timeout_ms=60000)
    full, _ = prompt_keys(PROMPT)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
    p.side.save((SaveJob("p", tuple(full[:1]), tuple(P_BLOCKS[:2]), publish="t1"),))
    time.sleep(0.3)
    start = time.monotonic()
    p.side.announce((), withdrawn=("t1",))  # the next step after P's request was aborted
    assert d.wait_loaded("d-req", timeout_s=30) == set(D_BLOCKS[2:])  # what was sealed still arrives
    assert time.monotonic() - start < 30  # not the 60 s timeout
    assert torch.equal(d.blocks(D_BLOCKS[:2]), p.blocks(P_BLOCKS[:2]))


def test_a_chunk_whose_save_is_dropped_is_answered_missing_not_left_waiting(engines):
    """P parks a fetch for a chunk its save executor is still storing; if that save is then dropped
    (backlog full) or fails, nothing announces it: P looks again once a second and answers
    ``missing``, so D recomputes at once instead of waiting out its timeout."""
    p, d = engines("p", 1), engines("d", 2, pd_timeout_ms=60000)
    saving = [True]
    p.side.chunk_server._saving = lambda key: saving[0]  # stands for a queued save of every chunk
    start = time.monotonic()
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    time.sleep(0.5)
    saving[0] = False  # the save was dropped: the chunk will never be stored
    assert d.wait_loaded("d-req", timeout_s=30) == set(D_BLOCKS)
    assert time.monotonic() - start < 10  # not the 60 s timeout


@pytest.mark.parametrize("wait", [False, True], ids=["pull", "push"])
def test_chunks_a_full_save_backlog_gives_up_are_answered_missing_at_once(engines, transport, wait):
    """A prompt larger than P's save backlog (``save_backlog_bytes``): the chunks that do not fit
    are never stored. P tells D ``missing`` for them at once (D keeps what arrived and recomputes
    the rest) instead of leaving D to wait out its timeout for chunks that will never come."""
    p, d = engines("p", 1, save_backlog_bytes=20 << 10), engines("d", 2, pd_timeout_ms=20000)  # one 16 KiB chunk fits
    start = time.monotonic()
    if wait:
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint, wait=True),))
        time.sleep(0.2)  # D waits before P computes
    publish(p, PROMPT, P_BLOCKS, "t1")
    if not wait:
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    failed = d.wait_loaded("d-req", timeout_s=30)
    assert time.monotonic() - start < 8, "D waited for chunks P had given up"
    assert p.side.transfers.stats.dropped_saves > 0 and failed, "the backlog held the whole prompt: nothing tested"
    loaded = [i for i, b in enumerate(D_BLOCKS) if b not in failed]
    assert torch.equal(d.blocks([D_BLOCKS[i] for i in loaded]), p.blocks([P_BLOCKS[i] for i in loaded]))


@pytest.mark.parametrize("push", ["read", "write"])
def test_a_chunk_computed_looks_again_only_at_the_fetches_waiting_for_it(engines, transport, push):
    """A push consumer asks for every chunk before P computed any; P then computes, sums and
    stores them one by one. Each must look again only at the fetch waiting for that chunk:
    looking at every waiting fetch each time is quadratic Python on P's server thread, which
    takes the GIL from P's engine thread during the prefill (30 chunks: 465 looks, not 30)."""
    tokens = tokens_of(30 * CHUNK, seed=3)
    p_blocks, d_blocks = list(range(2, 62)), list(range(1, 61))
    p, d = engines("p", 1), engines("d", 2, pd_hbm_push=push)
    server = p.side.chunk_server
    looks, fetch = [0], server._fetch

    def counted(*args):
        looks[0] += 1
        return fetch(*args)

    server._fetch = counted
    keys, _ = prompt_keys(tokens)
    d.side.start_loads((remote_job("d-req", tokens, d_blocks, "t1", p.endpoint, wait=True),))
    p.side.save((SaveJob("p", (), (), publish="t1", lease=True),))  # P's first step: computing, nothing sealed yet
    deadline = time.monotonic() + 10
    waiting = 4 if transport == "zmq" else len(keys)  # a window of fetches over ZMQ, all of them HBM to HBM
    while len(server._waiting) < waiting and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(server._waiting) == waiting, "D's fetches did not wait"
    hbm = transport != "zmq" and push == "write"  # the fetches name D's engine blocks: P's saves wait for their forwards
    while server.pushing != hbm and time.monotonic() < deadline:
        time.sleep(0.002)
    assert server.pushing == hbm
    looks[0] = 0
    for i, key in enumerate(keys):  # one chunk a step, each served before the next step
        p.side.save((SaveJob("p", (key,), tuple(p_blocks[2 * i : 2 * i + 2]), publish="t1",
                             final=i == len(keys) - 1, lease=True),))
        while server.served_total <= i and time.monotonic() < deadline:
            time.sleep(0.002)
    assert d.wait_loaded("d-req") == set()
    assert torch.equal(d.blocks(d_blocks), p.blocks(p_blocks))
    while server.pushing and time.monotonic() < deadline:
        time.sleep(0.002)
    assert not server.pushing, "P still counts as pushing once its WRITEs are done"
    # each chunk's own look and a new fetch's first (ZMQ), plus one look at all of those waiting
    # for the last announcement and once a second: not one at every waiting fetch for each chunk
    assert looks[0] <= 3 * len(keys), f"{looks[0]} looks for {len(keys)} chunks"
