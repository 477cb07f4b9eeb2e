"""What a disk tier directory holds, checked without an engine: every chunk file whole and valid.

Used by ``kvtier-bench soak`` after a server stops, and by the fault and shutdown tests."""

from __future__ import annotations

from pathlib import Path

import torch

from kvtier.codec import HEADER_BYTES
from kvtier.codec.chunk import CHECKSUM_BLAKE3, ChunkError, checksum, read_header


def bad_chunk_files(disk: Path) -> list[str]:
    """Chunk files (``*.kv``, any depth) that are not whole, valid chunks: size other than the one
    in their name, or a header or BLAKE3 payload checksum that does not match. One line each."""
    bad = []
    for path in sorted(Path(disk).rglob("*.kv")):
        data = path.read_bytes()
        expected = int(path.name.rsplit(".", 2)[1])
        if len(data) != expected:
            bad.append(f"{path.name}: {len(data)} bytes, name says {expected}")
            continue
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        try:
            header = read_header(buf)
        except ChunkError as exc:
            bad.append(f"{path.name}: {exc}")
            continue
        payload = buf[HEADER_BYTES : HEADER_BYTES + header.payload_bytes]
        if HEADER_BYTES + header.payload_bytes > len(data):
            bad.append(f"{path.name}: header says {header.payload_bytes} payload bytes")
        elif header.checksum_kind == CHECKSUM_BLAKE3 and checksum(payload) != header.checksum:
            bad.append(f"{path.name}: payload checksum mismatch")
    return bad
