"""A producer rank cuts a decode rank's heads out of its stored chunk (kvtier.pd.producer.slicing):
the cut is byte for byte the chunk that decode rank would have saved itself, sealed under its
fingerprint, at every layout kind; a flipped byte anywhere in the stored chunk fails the cut; the
next rank's cut of a copy checked whole reads only its own heads, and a copy stored anew is
checked again."""

from __future__ import annotations

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


@pytest.mark.parametrize("kind", ["cpu", "nhd"])
def test_a_flipped_byte_in_heads_the_decode_rank_does_not_take_fails_the_cut(store, kind, caplog):
    mine, _ = layout_of(kind, reference(kind, seed=6), 0, 1)
    part = head_slice(mine, rank_heads(HEADS, 0, 2))
    skey, buffer = stored(store, mine)
    buffer.data[-1] ^= 0x01  # the last byte: in the last head, rank 1's
    assert Cutter(store).cut(buffer, skey, mine, part, "chunk X") is None
    assert store.contains(skey) is None  # removed: no later fetch is served from it
    assert "chunk X is unusable" in caplog.text


def test_the_next_rank_s_cut_of_a_checked_copy_reads_only_its_heads(store):
    mine, _ = layout_of("cpu", reference("cpu", seed=7), 0, 1)
    theirs = [layout_of("cpu", reference("cpu", seed=7), r, 2)[0] for r in range(2)]
    cutter = Cutter(store)
    skey, first = stored(store, mine)
    copy = store.get(skey)
    outs = [cutter.cut(b, skey, mine, head_slice(mine, rank_heads(HEADS, r, 2)), "chunk")
            for r, b in enumerate((first, copy))]
    assert cutter.total == 2 and cutter.checked_once == 1  # the second read its own heads only
    for out, layout in zip(outs, theirs):
        assert torch.equal(out.data[codec.HEADER_BYTES:][: layout.payload_bytes(len(IDS))], payload(layout, IDS))
        codec.verify_chunk(out.data, layout, len(IDS))
        out.release()
    assert not store._outstanding  # the copy was let go once both ranks had their cut


def test_a_copy_stored_anew_under_the_key_is_checked_again(store, caplog):
    mine, _ = layout_of("cpu", reference("cpu", seed=8), 0, 1)
    part = head_slice(mine, rank_heads(HEADS, 0, 2))
    cutter = Cutter(store)
    skey, buffer = stored(store, mine)
    cutter.cut(buffer, skey, mine, part, "chunk").release()  # the copy stays held for rank 1's cut
    store.remove(skey)
    buffer = store.allocate(codec.chunk_bytes(mine, len(IDS)))  # stored anew (elsewhere), its bytes rotten since
    buffer.data[codec.HEADER_BYTES:] = payload(mine, IDS)
    codec.write_header(buffer.data, mine, len(IDS), kind=codec.KVSUM64)
    buffer.data[-1] ^= 0x01
    store.put([skey], [buffer])
    assert cutter.cut(store.get(skey), skey, mine, part, "chunk Y") is None
    assert cutter.checked_once == 0 and "chunk Y is unusable" in caplog.text
    cutter.close()
    assert not store._outstanding


@pytest.mark.parametrize("bound", ["HELD_S", "CHECKED_KEPT"])
def test_a_copy_is_held_no_longer_and_no_more_than_the_bounds(store, monkeypatch, bound):
    """A rank that never comes for its cut (its request gone) holds nothing for long."""
    monkeypatch.setattr(slicing, bound, -1.0 if bound == "HELD_S" else 1)
    mine, _ = layout_of("cpu", reference("cpu", seed=9), 0, 1)
    part = head_slice(mine, rank_heads(HEADS, 0, 2))
    cutter = Cutter(store)
    skey, buffer = stored(store, mine)
    cutter.cut(buffer, skey, mine, part, "chunk").release()
    store.remove(skey)  # a second chunk: the first stays held only if the bounds allow
    skey, buffer = stored(store, mine)
    cutter.cut(buffer, skey, mine, part, "chunk").release()
    assert len(store._outstanding) == (0 if bound == "HELD_S" else 1)
    cutter.close()
    assert not store._outstanding
