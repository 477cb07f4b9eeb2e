"""A producer rank cuts a decode rank's heads out of its stored chunk (kvtier.pd.producer.slicing):
the cut is byte for byte the chunk that decode rank would have saved itself, sealed under its
fingerprint, at every layout kind; a flipped byte anywhere in the stored chunk fails the cut; the
first rank's cut cuts the other ranks' parts in the same pass, and they get them from it; a copy
stored anew is cut again, and checked again."""

from __future__ import annotations

import gc

import pytest
import torch

from kvtier import codec
from kvtier.codec.chunk import CHECKSUM_BLAKE3
from kvtier.keys import storage_key
from kvtier.pd.producer import slicing
from kvtier.pd.producer.slicing import Cutter, head_slice
from kvtier.shards import rank_heads
from test_pieces import IDS, KEY, store  # noqa: F401 (store: a fixture)
from test_shards import HEADS, layout_of, payload, reference


def stored(store, layout, checksum=codec.KVSUM64):
    """``layout``'s chunk of blocks ``IDS`` in ``store`` (sealed with ``checksum``): its key and buffer."""
    buf = store.allocate(codec.chunk_bytes(layout, len(IDS)))
    buf.data[codec.HEADER_BYTES:] = payload(layout, IDS)
    codec.write_header(buf.data, layout, len(IDS), kind=checksum)
    skey = storage_key(KEY, layout.fingerprint)
    store.put([skey], [buf])
    return skey, store.get(skey)


@pytest.mark.parametrize("checksum", [codec.KVSUM64, CHECKSUM_BLAKE3], ids=["kvsum64", "blake3"])
@pytest.mark.parametrize("kind", ["cpu", "nhd", "hnd", "flashinfer", "lbnhc"])
@pytest.mark.parametrize("writer, reader", [(1, 2), (1, 4), (2, 4)])
def test_the_cut_is_the_decode_rank_s_own_chunk(store, kind, writer, reader, checksum):
    ref = reference(kind, seed=5)
    for w in range(writer):
        mine, _ = layout_of(kind, ref, w, writer)
        for r in range(w * reader // writer, (w + 1) * reader // writer):  # the decode ranks whose heads it holds
            theirs, _ = layout_of(kind, ref, r, reader)
            part = head_slice(mine, rank_heads(HEADS, r, reader))
            assert part is not None and part.fingerprint == theirs.fingerprint
            skey, buffer = stored(store, mine, checksum)
            out = Cutter(store).cut(buffer, skey, mine, part, "chunk")
            assert out is not None
            header = codec.verify_chunk(out.data, theirs, len(IDS))
            assert header.checksum_kind == codec.KVSUM64
            assert torch.equal(out.data[codec.HEADER_BYTES : codec.HEADER_BYTES + header.payload_bytes],
                               payload(theirs, IDS))
            out.release()


def test_no_part_outside_or_equal_to_the_rank_s_heads():
    mine, _ = layout_of("cpu", reference("cpu"), 1, 2)  # heads 4-8
    assert head_slice(mine, (4, 8)) is None and head_slice(mine, (2, 6)) is None and head_slice(mine, (0, 4)) is None
    assert head_slice(mine, (6, 8)) is not None


@pytest.mark.parametrize("checksum", [codec.KVSUM64, CHECKSUM_BLAKE3], ids=["kvsum64", "blake3"])
@pytest.mark.parametrize("kind", ["cpu", "nhd"])
def test_a_flipped_byte_in_heads_the_decode_rank_does_not_take_fails_the_cut(store, kind, caplog, checksum):
    mine, _ = layout_of(kind, reference(kind, seed=6), 0, 1)
    part = head_slice(mine, rank_heads(HEADS, 0, 2))
    skey, buffer = stored(store, mine, checksum)
    buffer.data[-1] ^= 0x01  # the last byte: in the last head, rank 1's
    assert Cutter(store).cut(buffer, skey, mine, part, "chunk X") is None
    assert store.contains(skey) is None  # removed: no later fetch is served from it
    assert "chunk X is unusable" in caplog.text


@pytest.mark.parametrize("checksum", [codec.KVSUM64, CHECKSUM_BLAKE3], ids=["kvsum64", "blake3"])
@pytest.mark.parametrize("reader", [2, 4])
def test_the_first_rank_s_cut_cuts_every_rank_s_part(store, reader, checksum):
    mine, _ = layout_of("cpu", reference("cpu", seed=7), 0, 1)
    theirs = [layout_of("cpu", reference("cpu", seed=7), r, reader)[0] for r in range(reader)]
    cutter = Cutter(store)
    skey, buffer = stored(store, mine, checksum)
    buffer.release()
    outs = [cutter.cut(store.get(skey), skey, mine, head_slice(mine, rank_heads(HEADS, r, reader)), "chunk")
            for r in reversed(range(reader))]  # in any order
    assert cutter.total == reader and cutter.cut_ahead == reader - 1  # one pass cut them all
    for out, layout in zip(reversed(outs), theirs):
        assert torch.equal(out.data[codec.HEADER_BYTES:][: layout.payload_bytes(len(IDS))], payload(layout, IDS))
        codec.verify_chunk(out.data, layout, len(IDS))
        out.release()
    assert not store._outstanding  # nothing held once every rank had its part


def test_a_chunk_cut_twice_before_the_other_rank_came_keeps_one_part(store, caplog):
    """Two transfers of one prompt: rank 0 fetches the chunk twice before rank 1 fetches it once."""
    mine, _ = layout_of("cpu", reference("cpu", seed=7), 0, 1)
    cutter = Cutter(store)
    skey, buffer = stored(store, mine)
    buffer.release()
    used = store.cpu_bytes_used()  # the stored chunk's
    for r in (0, 0, 1, 1):
        cutter.cut(store.get(skey), skey, mine, head_slice(mine, rank_heads(HEADS, r, 2)), "chunk").release()
    assert cutter.total == 4 and cutter.cut_ahead == 1  # rank 1's second fetch cut anew
    cutter.close()
    gc.collect()
    assert store.cpu_bytes_used() == used and "without release" not in caplog.text  # the replaced part was let go


def test_without_room_for_every_part_each_cut_is_its_own_pass(store, monkeypatch):
    mine, _ = layout_of("cpu", reference("cpu", seed=7), 0, 1)
    monkeypatch.setattr(slicing, "seal_split", lambda *a: None)  # what no room gives
    cutter = Cutter(store)
    skey, buffer = stored(store, mine)
    buffer.release()
    for r in range(2):
        out = cutter.cut(store.get(skey), skey, mine, head_slice(mine, rank_heads(HEADS, r, 2)), "chunk")
        codec.verify_chunk(out.data, layout_of("cpu", reference("cpu", seed=7), r, 2)[0], len(IDS))
        out.release()
    assert cutter.total == 2 and cutter.cut_ahead == 0
    assert not store._outstanding


def test_a_copy_stored_anew_under_the_key_is_cut_and_checked_again(store, caplog):
    mine, _ = layout_of("cpu", reference("cpu", seed=8), 0, 1)
    cutter = Cutter(store)
    skey, buffer = stored(store, mine)
    cutter.cut(buffer, skey, mine, head_slice(mine, rank_heads(HEADS, 0, 2)), "chunk").release()  # rank 1's part kept
    store.remove(skey)
    buffer = store.allocate(codec.chunk_bytes(mine, len(IDS)))  # stored anew, its bytes rotten since
    buffer.data[codec.HEADER_BYTES:] = payload(mine, IDS)
    codec.write_header(buffer.data, mine, len(IDS), kind=codec.KVSUM64)
    buffer.data[-1] ^= 0x01
    store.put([skey], [buffer])
    # rank 0 again (a later transfer): no part of its waits, so the copy now stored is cut, and checked
    assert cutter.cut(store.get(skey), skey, mine, head_slice(mine, rank_heads(HEADS, 0, 2)), "chunk Y") is None
    assert cutter.cut_ahead == 0 and "chunk Y is unusable" in caplog.text
    cutter.close()
    assert not store._outstanding


@pytest.mark.parametrize("bound", ["HELD_S", "PARTS_KEPT"])
def test_a_part_is_held_no_longer_and_no_more_than_the_bounds(store, monkeypatch, bound):
    """A rank that never comes for its part (its request gone) holds nothing for long."""
    monkeypatch.setattr(slicing, bound, -1.0 if bound == "HELD_S" else 1)
    mine, _ = layout_of("cpu", reference("cpu", seed=9), 0, 1)
    part = head_slice(mine, rank_heads(HEADS, 0, 2))
    cutter = Cutter(store)
    skey, buffer = stored(store, mine)
    cutter.cut(buffer, skey, mine, part, "chunk").release()
    store.remove(skey)  # a second chunk: the first one's part stays held only if the bounds allow
    skey, buffer = stored(store, mine)
    cutter.cut(buffer, skey, mine, part, "chunk").release()
    assert len(store._outstanding) == (0 if bound == "HELD_S" else 1)
    cutter.close()
    assert not store._outstanding
