"""Where bytes sit in a chunk buffer: the header's size, the chunk's size, each region's offset.

The lowest piece of the codec: the copy ops (:mod:`kvtier.ops`) read and write payloads by these
offsets, and the header code (:mod:`kvtier.codec.chunk`) seals them, so it imports nothing of
either.
"""

from __future__ import annotations

from kvtier.layout import Layout

HEADER_BYTES = 64


def chunk_bytes(layout: Layout, num_blocks: int) -> int:
    """Total bytes of a chunk of ``num_blocks`` blocks: header plus payload."""
    return HEADER_BYTES + layout.payload_bytes(num_blocks)


def region_bytes(layout: Layout, num_blocks: int) -> tuple[int, ...]:
    """Bytes of each region in a payload of ``num_blocks`` blocks (the payload is region-major)."""
    return tuple(num_blocks * region.block_bytes for region in layout.regions)


def region_offsets(layout: Layout, num_blocks: int) -> list[int]:
    """Byte offset, from the start of the chunk buffer, of block 0 of each region."""
    offsets, at = [], HEADER_BYTES
    for region in layout.regions:
        offsets.append(at)
        at += num_blocks * region.block_bytes
    return offsets
