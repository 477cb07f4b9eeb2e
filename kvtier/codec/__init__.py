"""The chunk byte format: a 64-byte header, then the payload region-major.

Payload of a chunk of ``n`` blocks: for each region ``r`` of the layout in order, blocks ``0..n-1``
of that region, each ``region.block_bytes`` long. Block ``j`` of region ``r`` therefore starts at
``HEADER_BYTES + n * sum(block_bytes of regions before r) + j * block_bytes[r]``, so any
sub-range of blocks can be read without touching the rest.

Header (little-endian): magic ``b"KVTC"``, format version (u16), checksum kind (u16),
layout fingerprint (16 B), block count (u32), reserved (u32), payload bytes (u64),
payload checksum (u64), zero padding to 64 bytes.
"""

from kvtier.codec.chunk import (
    HEADER_BYTES,
    ChunkError,
    ChunkHeader,
    checksum,
    chunk_bytes,
    read_header,
    region_offsets,
    verify_chunk,
    write_header,
)

__all__ = [
    "HEADER_BYTES",
    "ChunkError",
    "ChunkHeader",
    "checksum",
    "chunk_bytes",
    "read_header",
    "region_offsets",
    "verify_chunk",
    "write_header",
]
