"""Encode and verify chunk headers. See the package docstring for the byte format."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import blake3
import torch

from kvtier.layout import FORMAT_VERSION, Layout

MAGIC = b"KVTC"
HEADER_BYTES = 64
CHECKSUM_BLAKE3 = 1  # computed on the host, after a CPU gather
CHECKSUM_KVSUM64 = 2  # computed by the CUDA copy kernels while they gather (kvtier.ops.checksum)
_HEADER = struct.Struct("<4sHH16sIIQQ")


class ChunkError(ValueError):
    """A stored chunk that must not be loaded: corrupt, truncated, or from another layout."""


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    version: int
    checksum_kind: int
    fingerprint: bytes
    num_blocks: int
    payload_bytes: int
    checksum: int


def chunk_bytes(layout: Layout, num_blocks: int) -> int:
    """Total bytes of a chunk of ``num_blocks`` blocks: header plus payload."""
    return HEADER_BYTES + layout.payload_bytes(num_blocks)


def region_offsets(layout: Layout, num_blocks: int) -> list[int]:
    """Byte offset, from the start of the chunk buffer, of block 0 of each region."""
    offsets, at = [], HEADER_BYTES
    for region in layout.regions:
        offsets.append(at)
        at += num_blocks * region.block_bytes
    return offsets


def checksum(payload: torch.Tensor) -> int:
    """64-bit BLAKE3 of a contiguous ``uint8`` CPU tensor (~4 GB/s on one core)."""
    return int.from_bytes(blake3.blake3(memoryview(payload.numpy())).digest(8), "little")


def write_header(buf: torch.Tensor, layout: Layout, num_blocks: int, kvsum64: int | None = None) -> None:
    """Fill the header of chunk buffer ``buf`` (``uint8 [chunk_bytes]``, CPU) whose payload is written.

    ``kvsum64``: the payload's KVSUM64 as a copy kernel computed it (unsigned); None computes
    BLAKE3 here instead.
    """
    payload_bytes = layout.payload_bytes(num_blocks)
    if buf.numel() < HEADER_BYTES + payload_bytes:
        raise ChunkError(f"chunk buffer holds {buf.numel()} B, needs {HEADER_BYTES + payload_bytes} B.")
    if kvsum64 is None:
        kind, digest = CHECKSUM_BLAKE3, checksum(buf[HEADER_BYTES : HEADER_BYTES + payload_bytes])
    else:
        kind, digest = CHECKSUM_KVSUM64, kvsum64
    packed = _HEADER.pack(MAGIC, FORMAT_VERSION, kind, layout.fingerprint, num_blocks, 0, payload_bytes, digest)
    buf[:HEADER_BYTES].zero_()
    buf[: len(packed)].copy_(torch.frombuffer(bytearray(packed), dtype=torch.uint8))


def read_header(buf: torch.Tensor) -> ChunkHeader:
    """Parse the header of ``buf``; raises :class:`ChunkError` on a bad magic or short buffer."""
    if buf.numel() < HEADER_BYTES:
        raise ChunkError(f"chunk of {buf.numel()} B is shorter than its {HEADER_BYTES} B header.")
    magic, version, kind, fingerprint, blocks, _, payload_bytes, digest = _HEADER.unpack(
        buf[: _HEADER.size].numpy().tobytes()
    )
    if magic != MAGIC:
        raise ChunkError(f"bad magic {magic!r}: not a kvtier chunk.")
    return ChunkHeader(version, kind, fingerprint, blocks, payload_bytes, digest)


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
    if header.checksum_kind not in (CHECKSUM_BLAKE3, CHECKSUM_KVSUM64):
        raise ChunkError(f"unknown checksum kind {header.checksum_kind}.")
    if payload and _payload_checksum(buf[HEADER_BYTES : HEADER_BYTES + expected], header.checksum_kind) != header.checksum:
        raise ChunkError("chunk payload checksum mismatch (corrupt bytes).")
    return header


def _payload_checksum(payload: torch.Tensor, kind: int) -> int:
    if kind == CHECKSUM_BLAKE3:
        return checksum(payload)
    from kvtier.ops.checksum import payload_checksum  # the kernels' checksum; slow on a CPU

    return payload_checksum(payload)
