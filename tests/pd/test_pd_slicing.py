"""A producer rank cuts a decode rank's heads out of its stored chunk (kvtier.pd.producer.slicing):
the cut is byte for byte the chunk that decode rank would have saved itself, sealed under its
fingerprint, at every layout kind; a flipped byte anywhere in the stored chunk fails the cut."""

from __future__ import annotations

import pytest
import torch

from kvtier import codec
from kvtier.codec.chunk import CHECKSUM_BLAKE3
from kvtier.keys import storage_key
from kvtier.pd.producer.slicing import cut, head_slice
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
            out = cut(store, buffer, skey, mine, part, "chunk")
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
    assert cut(store, buffer, skey, mine, part, "chunk X") is None
    assert store.contains(skey) is None  # removed: no later fetch is served from it
    assert "chunk X is unusable" in caplog.text
