"""A chunk joined from pieces that hold other ranks' KV heads (:mod:`kvtier.shards`), sealed anew."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from kvtier.codec.chunk import CHECKSUM_KVSUM64, write_header
from kvtier.codec.geometry import HEADER_BYTES
from kvtier.layout import Layout
from kvtier.ops import cpu_library
from kvtier.ops.cpu_ops import copy_summed
from kvtier.shards import HeadRange, join_pieces, join_plan

if TYPE_CHECKING:
    from kvtier.storage import ChunkBuffer


def seal_joined(layout: Layout, num_blocks: int, pieces: list[tuple[HeadRange, ChunkBuffer]],
                allocate: Callable[[int], ChunkBuffer | None]) -> ChunkBuffer | None:
    """A chunk of ``num_blocks`` blocks of ``layout``'s heads in a fresh buffer of ``allocate(bytes)``,
    its payload joined from ``pieces`` (the heads each holds, its buffer: header and payload, already
    verified by the caller) and sealed with a KVSUM64, summed while the heads are copied where the C
    library is built (one pass over the bytes, not two). None when ``allocate`` has no room. The
    pieces stay the caller's to release."""
    payload = layout.payload_bytes(num_blocks)
    built = allocate(HEADER_BYTES + payload)
    if built is None:
        return None
    region_bytes = tuple(region.block_bytes * num_blocks for region in layout.regions)
    dst = built.data[HEADER_BYTES : HEADER_BYTES + payload]
    plan = join_plan(layout.shard, region_bytes, tuple(heads for heads, _ in pieces))
    if cpu_library.available() and not np.any(plan[:, 1:] % 4):  # one pass: the copy sums as it writes
        kvsum = copy_summed(dst, [piece.data[HEADER_BYTES:] for _, piece in pieces], plan)
        write_header(built.data, layout, num_blocks, kvsum64=kvsum)
    else:  # a copy, then the checksum's own pass
        join_pieces(dst, layout.shard, region_bytes, [(heads, piece.data[HEADER_BYTES:]) for heads, piece in pieces])
        write_header(built.data, layout, num_blocks, kind=CHECKSUM_KVSUM64)
    return built
