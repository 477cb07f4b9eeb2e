"""A load at one TP size of chunks saved at another, through TierWorker on the real LMCache store:
on a CPU engine each piece goes straight into the engine's head slices, checked as it is copied
(no joined chunk is built or stored), a partial first chunk included; a flipped byte in any piece
fails the chunk and removes its pieces."""

from __future__ import annotations

import pytest
import torch

from kvtier.jobs import LoadJob, SaveJob
from kvtier.keys import chunk_keys, namespace, storage_key
from kvtier.layout import build_layout
from kvtier.ops import cpu_library
from kvtier.shards import piece_fingerprint, rank_heads
from kvtier.storage import ChunkStore, StoreConfig
from kvtier.transfer import TierWorker

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the C copy library does not build here")

HEADS, BLOCK, CHUNK_BLOCKS, NUM_BLOCKS, LAYERS = 4, 16, 2, 32, 2


def engine(ref: torch.Tensor, rank: int, tp: int):
    """Rank ``rank`` of ``tp``'s vLLM-CPU KV (``[blocks, heads, BLOCK, 2*16]`` a layer): its heads of
    ``ref`` (``[blocks, LAYERS, HEADS, BLOCK, 32]``), its own allocation; and its layout."""
    first, end = rank_heads(HEADS, rank, tp)
    mine = ref[:, :, first:end].contiguous()
    layout = build_layout({f"l{i}": mine[:, i] for i in range(LAYERS)}, BLOCK, NUM_BLOCKS, model="m", tp_rank=rank,
                          tp_size=tp, kv_heads=HEADS // tp, total_kv_heads=HEADS)
    return mine, layout


@pytest.fixture
def store():
    with ChunkStore(StoreConfig(cpu_bytes=8 << 20)) as s:
        yield s


def save_all(store, ref, tp, ks, backend="auto"):
    """Every rank of a TP=``tp`` engine saves ``ks``' chunks from blocks 0.. into ``store``."""
    for rank in range(tp):
        _, layout = engine(ref, rank, tp)
        worker = TierWorker(layout, store, CHUNK_BLOCKS, backend=backend)
        try:
            assert worker.save([SaveJob("w", tuple(ks), tuple(range(len(ks) * CHUNK_BLOCKS)))]) == len(ks)
            worker.drain()
        finally:
            worker.close()


@pytest.mark.parametrize("writer, reader", [(1, 2), (2, 1), (4, 1), (1, 4)])
def test_a_load_at_another_tp_size_scatters_the_pieces_straight_into_its_blocks(store, writer, reader):
    ref = torch.randn(NUM_BLOCKS, LAYERS, HEADS, BLOCK, 32, generator=torch.Generator().manual_seed(writer + 10 * reader))
    ks = chunk_keys(list(range(3 * CHUNK_BLOCKS * BLOCK)), CHUNK_BLOCKS * BLOCK, namespace("m"))
    save_all(store, ref, writer, ks)
    for rank in range(reader):
        kv, layout = engine(torch.zeros_like(ref), rank, reader)
        want, _ = engine(ref, rank, reader)
        worker = TierWorker(layout, store, CHUNK_BLOCKS)
        try:
            # from block 1 of the first chunk on (a prefix hit ending inside it), into blocks 20..24
            assert worker.load(LoadJob("r", tuple(ks), 1, tuple(range(20, 25)))) == set()
        finally:
            worker.close()
        assert torch.equal(kv[20:25], want[1:6])
        assert not kv[:20].any() and not kv[25:].any()
        assert worker.stats.loaded_chunks == 3
        assert all(store.contains(storage_key(k, layout.fingerprint)) is None for k in ks)  # nothing joined, nothing kept


def test_a_flipped_byte_in_a_piece_fails_its_chunk_and_removes_its_pieces(store, caplog):
    ref = torch.randn(NUM_BLOCKS, LAYERS, HEADS, BLOCK, 32, generator=torch.Generator().manual_seed(3))
    ks = chunk_keys(list(range(3 * CHUNK_BLOCKS * BLOCK)), CHUNK_BLOCKS * BLOCK, namespace("m"))
    save_all(store, ref, 1, ks)
    kv, layout = engine(torch.zeros_like(ref), 0, 2)
    whole = storage_key(ks[1], piece_fingerprint(layout.shard.base, (0, HEADS)))
    bad = store.get(whole)
    bad.data[-4] ^= 0x01  # the last head's: rank 1's, which rank 0 does not take but must check
    bad.release()
    worker = TierWorker(layout, store, CHUNK_BLOCKS)
    try:
        failed = worker.load(LoadJob("r", tuple(ks), 0, tuple(range(10, 16))))
    finally:
        worker.close()
    assert failed == {12, 13, 14, 15}  # the second chunk on: recomputed
    want, _ = engine(ref, 0, 2)
    assert torch.equal(kv[10:12], want[0:2])
    assert store.contains(whole) is None and store.contains(storage_key(ks[0], piece_fingerprint(
        layout.shard.base, (0, HEADS)))) is not None
    assert f"KV heads 0-{HEADS}" in caplog.text and "unusable" in caplog.text


def test_pieces_a_copy_cannot_check_as_it_goes_are_joined_first(store):
    ref = torch.randn(NUM_BLOCKS, LAYERS, HEADS, BLOCK, 32, generator=torch.Generator().manual_seed(5))
    ks = chunk_keys(list(range(2 * CHUNK_BLOCKS * BLOCK)), CHUNK_BLOCKS * BLOCK, namespace("m"))
    save_all(store, ref, 2, ks, backend="torch")  # sealed with the host's checksum, not a KVSUM64
    kv, layout = engine(torch.zeros_like(ref), 0, 1)
    worker = TierWorker(layout, store, CHUNK_BLOCKS)
    try:
        assert worker.load(LoadJob("r", tuple(ks), 0, tuple(range(4)))) == set()
    finally:
        worker.close()
    assert torch.equal(kv[:4], ref[:4])
    assert all(store.contains(storage_key(k, layout.fingerprint)) is not None for k in ks)  # joined, kept
