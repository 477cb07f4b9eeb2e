"""The chunk byte format: a 64-byte header, then the payload region-major.

Payload of a chunk of ``n`` blocks: for each region ``r`` of the layout in order, blocks ``0..n-1``
of that region, each ``region.block_bytes`` long. Block ``j`` of region ``r`` therefore starts at
``HEADER_BYTES + n * sum(block_bytes of regions before r) + j * block_bytes[r]``, so any
sub-range of blocks can be read without touching the rest.

Header (little-endian): magic ``b"KVTC"``, format version (u16, now 3), checksum kind (u16,
:mod:`kvtier.codec.checksums`), layout fingerprint (16 B), token count (u32: blocks × the
writer's block size, so a token-contiguous layout's chunk reads the same under any block size),
reserved (u32), payload bytes (u64), payload checksum low 64 bits (u64), high 64 bits (u64,
xxh3-128 only, else 0), zero padding to 64 bytes. A chunk of another format version never loads.
"""

from kvtier.codec.chunk import (
    CHECKSUM_KVSUM64 as KVSUM64,
    DEFAULT_HOST_CHECKSUM,
    FORMAT_VERSION,
    ChunkError,
    ChunkHeader,
    checksum,
    read_header,
    retoken,
    verify_chunk,
    write_header,
)
from kvtier.codec.geometry import HEADER_BYTES, chunk_bytes, region_offsets

__all__ = [
    "DEFAULT_HOST_CHECKSUM",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "KVSUM64",
    "ChunkError",
    "ChunkHeader",
    "checksum",
    "chunk_bytes",
    "read_header",
    "region_offsets",
    "retoken",
    "verify_chunk",
    "write_header",
]
