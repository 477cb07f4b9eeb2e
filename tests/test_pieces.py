"""A load that finds no chunk under its rank's key builds it from another TP size's stored pieces
(kvtier.transfer.pieces); rank 0's index counts such a chunk as held (kvtier.lookup.index)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier import codec
from kvtier.keys import storage_key
from kvtier.lookup import HoldIndex
from kvtier.lookup.protocol import VERSION, HoldReport
from kvtier.shards import rank_heads
from kvtier.storage import ChunkStore, StoreConfig, Tier
from kvtier.transfer.pieces import assemble, to_read
from test_shards import HEADS, layout_of, payload, reference

KEY = bytes(range(16))
IDS = [2, 0, 5]


@pytest.fixture
def store():
    with ChunkStore(StoreConfig(cpu_bytes=16 << 20)) as s:
        yield s


def store_pieces(store, kind, ref, tp_size, checksum=codec.KVSUM64):
    """Every rank's chunk of ``KEY`` as a TP=``tp_size`` engine saves it (sealed with ``checksum``;
    an engine's copy kernels seal with KVSUM64), all in ``store``; their keys."""
    skeys = []
    for r in range(tp_size):
        layout, _ = layout_of(kind, ref, r, tp_size)
        buf = store.allocate(codec.chunk_bytes(layout, len(IDS)))
        buf.data[codec.HEADER_BYTES:] = payload(layout, IDS)
        codec.write_header(buf.data, layout, len(IDS), kind=checksum)
        skeys.append(storage_key(KEY, layout.fingerprint))
        store.put([skeys[-1]], [buf])
    return skeys


@pytest.mark.parametrize("kind", ["cpu", "nhd"])
@pytest.mark.parametrize("writer, reader", [(1, 2), (2, 1)])
def test_a_chunk_built_from_pieces_is_the_readers_own_and_is_stored_under_its_key(store, kind, writer, reader):
    ref = reference(kind, seed=3)
    store_pieces(store, kind, ref, writer)
    for r in range(reader):
        layout, _ = layout_of(kind, ref, r, reader)
        held = []
        buffer = assemble(layout, store, KEY, len(IDS), held.extend)
        assert buffer is not None
        header = codec.verify_chunk(buffer.data, layout, len(IDS))
        assert header.checksum_kind == codec.KVSUM64
        assert torch.equal(buffer.data[codec.HEADER_BYTES:], payload(layout, IDS))
        buffer.release()
        own = storage_key(KEY, layout.fingerprint)
        assert held == [own] and store.contains(own) is Tier.CPU  # the next load finds it directly


def test_a_load_reads_ahead_the_pieces_it_will_join_else_its_own_chunk(store):
    ref = reference("cpu", seed=6)
    writers = store_pieces(store, "cpu", ref, 1)
    half, _ = layout_of("cpu", ref, 1, 2)
    own = storage_key(KEY, half.fingerprint)
    other = storage_key(bytes(16), half.fingerprint)
    # TP=1's whole piece holds rank 1's heads; nothing is stored for the other key
    assert list(to_read(half, store, [KEY, bytes(16)])) == writers + [other]
    assemble(half, store, KEY, len(IDS), lambda keys: None).release()
    assert list(to_read(half, store, [KEY])) == [own]  # joined once: its own chunk from then on


def test_a_corrupt_piece_is_removed_and_the_chunk_is_missing(store, caplog):
    ref = reference("cpu", seed=4)
    skeys = store_pieces(store, "cpu", ref, 2)
    bad = store.get(skeys[1])
    bad.data[codec.HEADER_BYTES + 100] ^= 0xFF  # the cached bytes themselves
    bad.release()
    layout, _ = layout_of("cpu", ref, 0, 1)
    assert assemble(layout, store, KEY, len(IDS), lambda keys: None) is None
    assert store.contains(skeys[1]) is None and store.contains(skeys[0]) is Tier.CPU
    assert store.contains(storage_key(KEY, layout.fingerprint)) is None
    assert "KV heads 4-8" in caplog.text and "checksum mismatch" in caplog.text


@pytest.mark.parametrize("checksum", [codec.KVSUM64, codec.DEFAULT_HOST_CHECKSUM])  # in the join's pass; one of its own
def test_a_flipped_byte_in_heads_the_reader_does_not_take_still_fails_the_piece(store, caplog, checksum):
    ref = reference("cpu", seed=7)
    (whole,) = store_pieces(store, "cpu", ref, 1, checksum)
    piece_layout, _ = layout_of("cpu", ref, 0, 1)
    head_bytes = piece_layout.regions[0].block_bytes // HEADS  # vLLM-CPU blocks: heads outermost
    bad = store.get(whole)
    bad.data[codec.HEADER_BYTES + (HEADS - 1) * head_bytes + 8] ^= 0x01  # the last head: rank 1's, not rank 0's
    bad.release()
    layout, _ = layout_of("cpu", ref, 0, 2)
    assert assemble(layout, store, KEY, len(IDS), lambda keys: None) is None
    assert store.contains(whole) is None and store.contains(storage_key(KEY, layout.fingerprint)) is None
    assert f"KV heads 0-{HEADS}" in caplog.text and "checksum mismatch" in caplog.text


def test_missing_pieces_or_a_per_rank_layout_build_nothing(store):
    ref = reference("cpu", seed=5)
    store_pieces(store, "cpu", ref, 2)
    store.remove(storage_key(KEY, layout_of("cpu", ref, 1, 2)[0].fingerprint))
    assert assemble(layout_of("cpu", ref, 0, 1)[0], store, KEY, len(IDS), lambda keys: None) is None
    # rank 0 at TP=4 needs heads 0-2: inside TP=2 rank 0's piece, which is still there
    assert assemble(layout_of("cpu", ref, 0, 4)[0], store, KEY, len(IDS), lambda keys: None) is not None
    per_rank = layout_of("cpu", ref, 0, 1)[0]
    assert assemble(dataclasses.replace(per_rank, shard=None), store, KEY, len(IDS), lambda keys: None) is None


def hold(layout, rank, world, keys, tiers):
    shard = layout.shard
    return HoldReport(VERSION, rank, world, layout.fingerprint, keys, tiers, shard.base,
                      [shard.first, shard.end, shard.total])


def test_the_index_counts_a_chunk_every_rank_can_build_from_pieces():
    ref = reference("cpu")
    writers = [layout_of("cpu", ref, r, 1)[0] for r in range(1)]
    readers = [layout_of("cpu", ref, r, 2)[0] for r in range(2)]
    whole = storage_key(KEY, writers[0].fingerprint)  # TP=1's piece: all heads, found by both ranks on disk
    index = HoldIndex(2)
    assert index.apply(hold(readers[0], 0, 2, [whole], ["disk"])) is None
    assert index.prefix_tiers([KEY]) == []  # rank 1 has not reported
    assert index.apply(hold(readers[1], 1, 2, [], [])) is None
    assert index.prefix_tiers([KEY]) == []  # rank 1 holds no piece of heads 4-8
    index.apply(hold(readers[1], 1, 2, [whole], ["disk"]))
    assert index.prefix_tiers([KEY]) == ["disk"]
    own = storage_key(KEY, readers[1].fingerprint)
    index.apply(hold(readers[1], 1, 2, [whole, own], ["", "cpu"]))  # its own piece built, the whole one gone
    index.apply(hold(readers[0], 0, 2, [storage_key(KEY, readers[0].fingerprint)], ["cpu"]))
    assert index.prefix_tiers([KEY]) == ["cpu"]
    # TP=1 reading two TP=2 pieces: both needed
    one = HoldIndex(1)
    one.apply(hold(writers[0], 0, 1, [storage_key(KEY, readers[0].fingerprint)], ["cpu"]))
    assert one.prefix_tiers([KEY]) == []
    one.apply(hold(writers[0], 0, 1, [storage_key(KEY, readers[1].fingerprint)], ["disk"]))
    assert one.prefix_tiers([KEY]) == ["disk"]
