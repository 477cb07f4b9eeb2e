"""A chunk joined from pieces that hold other ranks' KV heads (:mod:`kvtier.shards`), sealed anew."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from kvtier.codec.chunk import CHECKSUM_KVSUM64, ChunkError, ChunkHeader, checksum, write_header
from kvtier.codec.geometry import HEADER_BYTES, region_bytes
from kvtier.layout import Layout
from kvtier.ops import cpu_library
from kvtier.ops.cpu_pieces import aligned, join_checked
from kvtier.shards import HeadRange, join_pieces, join_plan

if TYPE_CHECKING:
    from kvtier.storage import ChunkBuffer


class CorruptPiece(ChunkError):
    """Piece ``index`` of a join failed its checksum: it must be removed, the chunk recomputed."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def seal_joined(layout: Layout, num_blocks: int, pieces: list[tuple[HeadRange, ChunkBuffer, ChunkHeader]],
                allocate: Callable[[int], ChunkBuffer | None], checked: bool = False) -> ChunkBuffer | None:
    """A chunk of ``num_blocks`` blocks of ``layout``'s heads in a fresh buffer of ``allocate(bytes)``,
    its payload joined from ``pieces`` (the heads each holds, its buffer, its header, already
    checked) and sealed with a KVSUM64. Each piece's payload is checked against its header's
    checksum: where the C library is built and the pieces carry KVSUM64s, in the same pass that
    copies their heads and sums the joined payload (each piece byte read once), else in a pass of
    its own first. Raises :class:`CorruptPiece` for the first piece that fails (the fresh buffer
    released); None when ``allocate`` has no room. The pieces stay the caller's to release.
    ``checked``: the pieces' payloads were checked whole already (in this process's memory, which
    nothing writes since): only the bytes copied are read."""
    payload = layout.payload_bytes(num_blocks)
    sizes = region_bytes(layout, num_blocks)
    heads = tuple(held for held, _, _ in pieces)
    sources = [piece.data[HEADER_BYTES : HEADER_BYTES + header.payload_bytes] for _, piece, header in pieces]
    one_pass = (cpu_library.available() and aligned(layout, heads, num_blocks)
                and all(s.numel() % 4 == 0 for s in sources)
                and all(header.checksum_kind == CHECKSUM_KVSUM64 for _, _, header in pieces))
    if not one_pass and not checked:
        for i, (source, (_, _, header)) in enumerate(zip(sources, pieces)):
            if checksum(source, header.checksum_kind) != header.checksum:
                raise CorruptPiece(i, "piece payload checksum mismatch (corrupt bytes)")
    built = allocate(HEADER_BYTES + payload)
    if built is None:
        return None
    dst = built.data[HEADER_BYTES : HEADER_BYTES + payload]
    if one_pass:  # copies the heads, sums what it writes and every byte of each piece
        kvsum, sums = join_checked(dst, sources, join_plan(layout.shard, sizes, heads), check=not checked)
        bad = next((i for i, (got, (_, _, header)) in enumerate(zip(sums, pieces)) if got != header.checksum), None)
        if bad is not None:
            built.release()
            raise CorruptPiece(bad, "piece payload kvsum64 checksum mismatch (corrupt bytes)")
        write_header(built.data, layout, num_blocks, kvsum64=kvsum)
    else:
        join_pieces(dst, layout.shard, sizes, list(zip(heads, sources)))
        write_header(built.data, layout, num_blocks, kind=CHECKSUM_KVSUM64)
    return built
