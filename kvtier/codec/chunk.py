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
# 3: the header counts tokens, not blocks (a token-contiguous layout's chunk is the same bytes
# under any block size).
# A chunk of another version is refused (and the loader removes it): it reads as a miss.
FORMAT_VERSION = 3
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
    tokens: int  # token slots the payload holds: blocks × the writer's block size
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
    _seal(buf, layout.fingerprint, num_blocks * layout.block_size, payload_bytes, kind, digest)


def _seal(buf: torch.Tensor, fingerprint: bytes, tokens: int, payload_bytes: int, kind: int, digest: int) -> None:
    packed = _HEADER.pack(MAGIC, FORMAT_VERSION, kind, fingerprint, tokens, 0, payload_bytes, digest & _M64, digest >> 64)
    buf[:HEADER_BYTES].numpy()[:] = np.frombuffer(packed.ljust(HEADER_BYTES, b"\0"), dtype=np.uint8)


def read_header(buf: torch.Tensor) -> ChunkHeader:
    """Parse the header of ``buf``; raises :class:`ChunkError` on a bad magic or short buffer."""
    if buf.numel() < HEADER_BYTES:
        raise ChunkError(f"chunk of {buf.numel()} B is shorter than its {HEADER_BYTES} B header.")
    magic, version, kind, fingerprint, tokens, _, payload_bytes, low, high = _HEADER.unpack(
        buf[: _HEADER.size].numpy().tobytes()
    )
    if magic != MAGIC:
        raise ChunkError(f"bad magic {magic!r}: not a kvtier chunk.")
    return ChunkHeader(version, kind, fingerprint, tokens, payload_bytes, low | high << 64)


def verify_chunk(buf: torch.Tensor, layout: Layout, num_blocks: int, payload: bool = True) -> ChunkHeader:
    """Check that ``buf`` is an intact chunk of ``num_blocks`` blocks written under ``layout``.

    Raises :class:`ChunkError` naming the first mismatch: magic, version, fingerprint, token count
    (``num_blocks`` of ``layout``'s blocks; the writer's block size may differ when the layout is
    token-contiguous, see :mod:`kvtier.layout`), size, or checksum. Only a chunk that passes may be scattered into the engine's blocks.
    ``payload=False`` checks the header only: for a copy kernel that verifies the checksum itself.
    """
    header = read_header(buf)
    if header.version != FORMAT_VERSION:
        raise ChunkError(f"chunk format version {header.version}, this kvtier reads {FORMAT_VERSION}.")
    if header.fingerprint != layout.fingerprint:
        raise ChunkError("chunk was written under another KV layout (fingerprint mismatch).")
    expected, tokens = layout.payload_bytes(num_blocks), num_blocks * layout.block_size
    if header.tokens != tokens or header.payload_bytes != expected:
        raise ChunkError(
            f"chunk holds {header.tokens} tokens / {header.payload_bytes} B, expected {num_blocks} blocks of "
            f"{layout.block_size} tokens / {expected} B."
        )
    if buf.numel() < HEADER_BYTES + expected:
        raise ChunkError(f"chunk truncated: {buf.numel()} B of {HEADER_BYTES + expected} B.")
    if header.checksum_kind not in checksums.NAMES:
        raise ChunkError(f"unknown checksum kind {header.checksum_kind}.")
    if payload and checksum(buf[HEADER_BYTES : HEADER_BYTES + expected], header.checksum_kind) != header.checksum:
        raise ChunkError(f"chunk payload {checksums.NAMES[header.checksum_kind]} checksum mismatch (corrupt bytes).")
    return header


def retoken(src: torch.Tensor, dst: torch.Tensor, token_bytes: tuple[int, ...], tokens: int,
            kind: int = DEFAULT_HOST_CHECKSUM) -> None:
    """Copy chunk ``src`` into ``dst`` as a chunk of ``tokens`` token slots, for a reader whose
    block size rounds a prompt's partial tail to another token count (token-contiguous layouts
    only: ``token_bytes``, bytes per token of each region, see :attr:`Layout.token_bytes`).

    ``src``: a sealed chunk, ``uint8`` CPU, its checksum checked here first (a corrupt chunk
    raises :class:`ChunkError`; it is never sealed anew). ``dst``: ``uint8
    [HEADER_BYTES + tokens * sum(token_bytes)]``, CPU. Per region, the first ``min(tokens,
    src tokens)`` token slices are copied and the slots past them zeroed (they lie past the
    prompt's end, which no reader attends to); ``dst`` is sealed with checksum ``kind``.
    """
    header = read_header(src)
    per_token = sum(token_bytes)
    if header.version != FORMAT_VERSION or header.payload_bytes != header.tokens * per_token:
        raise ChunkError(f"chunk of {header.tokens} tokens / {header.payload_bytes} B (format version "
                         f"{header.version}) does not fit {per_token} B per token.")
    if dst.numel() < HEADER_BYTES + tokens * per_token or src.numel() < HEADER_BYTES + header.payload_bytes:
        raise ChunkError(f"retoken buffers too small: {src.numel()} B / {dst.numel()} B.")
    if checksum(src[HEADER_BYTES : HEADER_BYTES + header.payload_bytes], header.checksum_kind) != header.checksum:
        raise ChunkError(f"chunk payload {checksums.NAMES.get(header.checksum_kind)} checksum mismatch (corrupt bytes).")
    at_src = at_dst = HEADER_BYTES
    for width in token_bytes:
        kept = min(tokens, header.tokens) * width
        dst[at_dst : at_dst + kept] = src[at_src : at_src + kept]
        dst[at_dst + kept : at_dst + tokens * width] = 0
        at_src, at_dst = at_src + header.tokens * width, at_dst + tokens * width
    payload = dst[HEADER_BYTES:at_dst]
    _seal(dst, header.fingerprint, tokens, payload.numel(), kind, checksum(payload, kind))
