"""Encode and verify chunk headers. See the package docstring for the byte format."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.codec import checksums
from kvtier.codec.geometry import HEADER_BYTES
from kvtier.layout import Layout

MAGIC = b"KVTC"
# 2: checksum kinds xxh3-128 and crc32c, a 128-bit checksum field, KVSUM64 also from host copies.
# A chunk of another version is refused (and the loader removes it): it reads as a miss.
FORMAT_VERSION = 2
CHECKSUM_BLAKE3 = checksums.BLAKE3
CHECKSUM_KVSUM64 = checksums.KVSUM64  # computed by the copy ops while they gather (kvtier.ops.checksum)
CHECKSUM_XXH3_128 = checksums.XXH3_128
CHECKSUM_CRC32C = checksums.CRC32C
DEFAULT_HOST_CHECKSUM = CHECKSUM_XXH3_128  # for a plain copy without its own checksum: fastest measured
_HEADER = struct.Struct("<4sHH16sIIQQQ")
_M64 = (1 << 64) - 1


class ChunkError(ValueError):
    """A stored chunk that must not be loaded: corrupt, truncated, or from another layout."""


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    version: int
    checksum_kind: int
    fingerprint: bytes
    num_blocks: int
    payload_bytes: int
    checksum: int  # up to 128 bits (xxh3-128); the others fit in 64


def checksum(payload: torch.Tensor, kind: int = DEFAULT_HOST_CHECKSUM) -> int:
    """Checksum ``kind`` of a contiguous ``uint8`` CPU tensor (see :mod:`kvtier.codec.checksums`)."""
    return checksums.compute(kind, payload)


def write_header(buf: torch.Tensor, layout: Layout, num_blocks: int, kvsum64: int | None = None,
                 kind: int = DEFAULT_HOST_CHECKSUM) -> None:
    """Fill the header of chunk buffer ``buf`` (``uint8 [chunk_bytes]``, CPU) whose payload is written.

    ``kvsum64``: the payload's KVSUM64 as a copy op computed it (unsigned); None computes
    checksum ``kind`` over the payload here instead.
    """
    payload_bytes = layout.payload_bytes(num_blocks)
    if buf.numel() < HEADER_BYTES + payload_bytes:
        raise ChunkError(f"chunk buffer holds {buf.numel()} B, needs {HEADER_BYTES + payload_bytes} B.")
    if kvsum64 is None:
        digest = checksum(buf[HEADER_BYTES : HEADER_BYTES + payload_bytes], kind)
    else:
        kind, digest = CHECKSUM_KVSUM64, kvsum64
    packed = _HEADER.pack(MAGIC, FORMAT_VERSION, kind, layout.fingerprint, num_blocks, 0, payload_bytes,
                          digest & _M64, digest >> 64)
    buf[:HEADER_BYTES].numpy()[:] = np.frombuffer(packed.ljust(HEADER_BYTES, b"\0"), dtype=np.uint8)


def read_header(buf: torch.Tensor) -> ChunkHeader:
    """Parse the header of ``buf``; raises :class:`ChunkError` on a bad magic or short buffer."""
    if buf.numel() < HEADER_BYTES:
        raise ChunkError(f"chunk of {buf.numel()} B is shorter than its {HEADER_BYTES} B header.")
    magic, version, kind, fingerprint, blocks, _, payload_bytes, low, high = _HEADER.unpack(
        buf[: _HEADER.size].numpy().tobytes()
    )
    if magic != MAGIC:
        raise ChunkError(f"bad magic {magic!r}: not a kvtier chunk.")
    return ChunkHeader(version, kind, fingerprint, blocks, payload_bytes, low | high << 64)


def verify_chunk(buf: torch.Tensor, layout: Layout, num_blocks: int, payload: bool = True) -> ChunkHeader:
    """Check that ``buf`` is an intact chunk of ``num_blocks`` blocks written under ``layout``.

    Raises :class:`ChunkError` naming the first mismatch: magic, version, fingerprint, block count,
    size, or checksum. Only a chunk that passes may be scattered into the engine's blocks.
    ``payload=False`` checks the header only: for a copy kernel that verifies the checksum itself.
    """
    header = read_header(buf)
    if header.version != FORMAT_VERSION:
        raise ChunkError(f"chunk format version {header.version}, this kvtier reads {FORMAT_VERSION}.")
    if header.fingerprint != layout.fingerprint:
        raise ChunkError("chunk was written under another KV layout (fingerprint mismatch).")
    expected = layout.payload_bytes(num_blocks)
    if header.num_blocks != num_blocks or header.payload_bytes != expected:
        raise ChunkError(
            f"chunk holds {header.num_blocks} blocks / {header.payload_bytes} B, expected {num_blocks} / {expected} B."
        )
    if buf.numel() < HEADER_BYTES + expected:
        raise ChunkError(f"chunk truncated: {buf.numel()} B of {HEADER_BYTES + expected} B.")
    if header.checksum_kind not in checksums.NAMES:
        raise ChunkError(f"unknown checksum kind {header.checksum_kind}.")
    if payload and checksum(buf[HEADER_BYTES : HEADER_BYTES + expected], header.checksum_kind) != header.checksum:
        raise ChunkError(f"chunk payload {checksums.NAMES[header.checksum_kind]} checksum mismatch (corrupt bytes).")
    return header
