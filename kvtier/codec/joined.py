"""A chunk joined from pieces that hold other ranks' KV heads (:mod:`kvtier.shards`), sealed anew."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from kvtier.codec.chunk import CHECKSUM_KVSUM64, write_header
from kvtier.codec.geometry import HEADER_BYTES
from kvtier.layout import Layout
from kvtier.shards import HeadRange, join_pieces

if TYPE_CHECKING:
    from kvtier.storage import ChunkBuffer


def seal_joined(layout: Layout, num_blocks: int, pieces: list[tuple[HeadRange, ChunkBuffer]],
                allocate: Callable[[int], ChunkBuffer | None]) -> ChunkBuffer | None:
    """A chunk of ``num_blocks`` blocks of ``layout``'s heads in a fresh buffer of ``allocate(bytes)``,
    its payload joined from ``pieces`` (the heads each holds, its buffer: header and payload, already
    verified by the caller) and sealed with a KVSUM64. None when ``allocate`` has no room. The
    pieces stay the caller's to release."""
    payload = layout.payload_bytes(num_blocks)
    built = allocate(HEADER_BYTES + payload)
    if built is None:
        return None
    region_bytes = tuple(region.block_bytes * num_blocks for region in layout.regions)
    join_pieces(built.data[HEADER_BYTES : HEADER_BYTES + payload], layout.shard, region_bytes,
                [(heads, piece.data[HEADER_BYTES:]) for heads, piece in pieces])
    write_header(built.data, layout, num_blocks, kind=CHECKSUM_KVSUM64)
    return built
