"""Engine block ids and KV regions that cannot be, through real worker halves and real NIXL over
UCX on loopback (host memory registered as DRAM stands in for VRAM, as in ``test_pd_hbm.py``).

The registration of an engine's KV merges its interleaved regions: one block past the end of a
layer's region is the next layer's first block, and NIXL takes it. So each side tells the other
its engine's block count in the handshake, and ids beyond it are refused before any descriptor
is built: a push fetch naming D's blocks beyond D's (P refuses it), a reply naming P's blocks
beyond P's (D refuses it), regions whose span cannot be (both refuse them at the handshake). D
then recomputes from there, and nothing bad is remembered for the next early READ."""

from __future__ import annotations

import logging

import pytest
import torch

from pd_workers import BLOCK, NUM_BLOCKS, publish, remote_job, wait_for
from test_pd_hbm import D_BLOCKS, P_BLOCKS, PROMPT, lend, wait_ended
from test_pd_hbm_named import early_reads, warm
from test_pd_hbm_push import FULL, step
from kvtier.codec import chunk_bytes
from kvtier.pd import nixl
from kvtier.pd.consumer import landing
from kvtier.pd.producer import writes
from kvtier.pd.consumer.fetch import Consumer, FetchSpec, PeerError, fetch_chunks
from kvtier.pd.route import PushMode
from kvtier.pd.hbm import Landing, RegionSpan

pytestmark = pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed: make test installs nixl-cu12")


@pytest.fixture
def transport() -> str:
    return "nixl"


def spy_descriptors(module, monkeypatch) -> list[list[int]]:
    """The peer's block ids of every READ or WRITE ``module`` builds descriptors for."""
    built, build = [], module.read_descriptors

    def spy(local, remote, mine, theirs):
        built.append(list(theirs))
        return build(local, remote, mine, theirs)

    monkeypatch.setattr(module, "read_descriptors", spy)
    return built


def push(p, d, block_ids: list[tuple[int, ...]], num_blocks: int, regions=None) -> None:
    """D's push of P's first two chunks (P WRITEs them), naming ``block_ids`` of D's engine KV,
    which D says has ``num_blocks`` blocks (its ``regions`` as given, else its own)."""
    kv = d.side.engine_kv
    target = Landing(regions or kv.spans, kv.kind, kv.device, block_ids, num_blocks=num_blocks)
    consumer = Consumer(d.side._hello, 1000, None, allocate=lambda n: d.side.store.allocate(n, wait=False),
                        chunk_bytes=lambda n: chunk_bytes(d.side.transfers.layout, n), nixl=d.side.nixl,
                        block_size=BLOCK, push_mode=PushMode.WRITE)
    for _ in fetch_chunks(consumer, FetchSpec(p.endpoint, "t1", [(FULL[0], 2), (FULL[1], 2)], True, landing=target)):
        pass


@pytest.mark.parametrize("named, claimed, why", [
    ([(40, 41), (2, 3)], NUM_BLOCKS // 2, "block 40 is beyond its engine's 32 blocks"),  # registered: NIXL takes it
    ([(40, 41, 42), (2, 3)], NUM_BLOCKS, "names 3 engine blocks to write for a chunk of 2"),
], ids=["beyond", "count"])
def test_a_push_naming_blocks_beyond_the_consumers_is_refused_before_any_write(engines, monkeypatch, caplog, named,
                                                                                claimed, why):
    """D names blocks 40 and 41 for chunk 0 but says its engine has 32 (its KV registered holds 64:
    NIXL would take them), or three blocks for a two-block chunk: P refuses that chunk with one
    line, builds no WRITE for it, and D's blocks change only where it named blocks that can be."""
    p, d = engines("p", 1), engines("d", 2, pd_hbm_push="write")
    step(p, 0, 3, final=True)  # P computed the prompt: it WRITEs each chunk from its blocks as asked
    built = spy_descriptors(writes, monkeypatch)
    before = d.kv.clone()
    with caplog.at_level(logging.WARNING, logger="kvtier"), pytest.raises(PeerError, match="refused"):
        push(p, d, named, claimed)
    assert why in caplog.text and "127.0.0.1" in caplog.text  # one line, naming the peer
    assert p.side.chunk_server.rejected == 1
    assert not any(set(ids) & set(named[0]) for ids in built)
    others = [b for b in range(NUM_BLOCKS) if b not in named[1]]
    assert torch.equal(d.kv[:, others], before[:, others]), "P wrote outside the blocks D named that can be"


def test_a_reply_naming_blocks_beyond_the_producers_is_refused_before_any_read(engines, monkeypatch, caplog):
    """P lends chunk 1 as blocks 64 and 65 of its 64 (:func:`lend_beyond`): D refuses the reply
    before building a READ of them and recomputes from where it stopped; what it loaded is P's."""
    p, d = engines("p", 1), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p, "t1")
    lend_beyond(p, monkeypatch)
    built = spy_descriptors(landing, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
        failed = d.wait_loaded("d-req")
    assert set(D_BLOCKS[2:4]) <= failed  # chunk 1 is recomputed (and what follows it)
    loaded = [i for i, b in enumerate(D_BLOCKS) if b not in failed]
    assert torch.equal(d.blocks([D_BLOCKS[i] for i in loaded]), p.blocks([P_BLOCKS[i] for i in loaded]))
    assert not any(NUM_BLOCKS in ids or NUM_BLOCKS + 1 in ids for ids in built)
    assert "named chunk 1's engine blocks wrongly: block 64 is beyond its engine's 64 blocks" in caplog.text
    wait_ended(p)  # released as any transfer


def bad_spans(spans: tuple[RegionSpan, ...], how: str) -> tuple[RegionSpan, ...]:
    """``spans`` with the first region's stride under its block's bytes, or its span past the address space."""
    first = spans[0]
    bad = (RegionSpan(first.base, first.block_bytes // 2, first.block_bytes) if how == "stride"
           else RegionSpan((1 << 63) - first.block_bytes, first.stride, first.block_bytes))
    return (bad, *spans[1:])


def lend_bad_regions(p, patch, how: str) -> None:
    """P's handshake replies give its engine KV regions as :func:`bad_spans` makes them."""
    hbm = p.side.chunk_server._hbm
    hello = hbm.hello

    def bad(*args):
        regions, *rest = hello(*args)
        spans = bad_spans(tuple(RegionSpan(*r) for r in regions), how) if regions else ()
        return (tuple((s.base, s.stride, s.block_bytes) for s in spans), *rest)

    patch.setattr(hbm, "hello", bad)


def lend_beyond(p, patch) -> None:
    """P lends chunk 1 of its prompt as blocks 64 and 65 of its 64 (one past the end of each
    layer's region: the next layer's first blocks, registered)."""
    leases = p.side.engine_kv.leases
    blocks = leases.blocks
    patch.setattr(leases, "blocks", lambda t, key, n: (NUM_BLOCKS, NUM_BLOCKS + 1) if key == FULL[1]
                  else blocks(t, key, n))


@pytest.mark.parametrize("how, why", [("stride", "has a stride of"), ("overflow", "overflows the address space")])
def test_a_producer_lending_regions_that_cannot_be_is_refused_at_the_handshake(engines, monkeypatch, caplog, how, why):
    p, d = engines("p", 1), engines("d", 2)
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p, "t1")
    lend_bad_regions(p, monkeypatch, how)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
        assert d.wait_loaded("d-req") == set(D_BLOCKS)  # recomputed
    assert "lends engine KV that cannot be: engine KV region 0 " in caplog.text and why in caplog.text
    assert (d.side.nixl.name, p.endpoint) not in landing._known  # nothing remembered for an early READ
    wait_ended(p)


@pytest.mark.parametrize("how, why", [("stride", "has a stride of"), ("overflow", "overflows the address space")])
def test_a_consumer_giving_regions_that_cannot_be_is_refused_at_the_handshake(engines, caplog, how, why):
    """D's push hello gives regions P would WRITE into: P refuses the hello (D's NIXL agent is
    never reached) and D recomputes."""
    p, d = engines("p", 1), engines("d", 2, pd_hbm_push="write")
    step(p, 0, 3, final=True)
    with caplog.at_level(logging.WARNING, logger="kvtier"), pytest.raises(PeerError, match="refused"):
        push(p, d, [(2, 3), (4, 5)], NUM_BLOCKS, bad_spans(d.side.engine_kv.spans, how))
    assert "a hello whose engine KV region 0 " in caplog.text and why in caplog.text
    assert d.side.nixl.name not in p.side.nixl.peer_names


@pytest.mark.parametrize("bad", ["regions", "blocks"])
def test_after_a_bad_reply_the_next_good_transfer_still_reads_early(engines, monkeypatch, caplog, bad):
    """A handshake reply with regions that cannot be, or a reply naming blocks beyond P's, ends
    that transfer (its early READ from what D knew of P included) but leaves what an earlier good
    handshake told D: the next good transfer READs P's named blocks before P's reply, as before."""
    p, d = engines("p", 1), engines("d", 2)
    warm(p, d)  # D learns P's agent and regions
    with monkeypatch.context() as patch:
        if bad == "regions":
            lend_bad_regions(p, patch, "stride")
        else:
            lend_beyond(p, patch)
        publish(p, PROMPT, P_BLOCKS, "t-bad")
        lend(p, "t-bad")
        d.side.start_loads((remote_job("d-bad", PROMPT, D_BLOCKS, "t-bad", p.endpoint,
                                       producer_blocks=tuple(P_BLOCKS)),))
        assert set(D_BLOCKS[2:]) <= d.wait_loaded("d-bad")
        wait_ended(p)
    publish(p, PROMPT, P_BLOCKS, "t-good")
    lend(p, "t-good")
    with caplog.at_level(logging.DEBUG, logger="kvtier"):
        d.side.start_loads((remote_job("d-good", PROMPT, D_BLOCKS, "t-good", p.endpoint,
                                       producer_blocks=tuple(P_BLOCKS)),))
        assert d.wait_loaded("d-good") == set()
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
    assert early_reads(caplog)[-1] == (1, 4)  # one READ, every chunk READ before P's reply
    wait_for(lambda: p.side.engine_kv.held_bytes == 0)
