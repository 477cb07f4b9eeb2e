"""A chunk joined from pieces that hold other ranks' KV heads (:mod:`kvtier.shards`), sealed anew; and the
other way round, one piece split into the parts other ranks hold, each sealed anew."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from kvtier.codec.chunk import CHECKSUM_KVSUM64, ChunkError, ChunkHeader, checksum, write_header
from kvtier.codec.geometry import HEADER_BYTES, region_bytes
from kvtier.layout import Layout
from kvtier.ops import cpu_library
from kvtier.ops.cpu_pieces import aligned, join_checked, split_checked, split_plan
from kvtier.shards import HeadRange, join_pieces, join_plan

if TYPE_CHECKING:
    from kvtier.storage import ChunkBuffer


class CorruptPiece(ChunkError):
    """Piece ``index`` of a join failed its checksum: it must be removed, the chunk recomputed."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def seal_joined(layout: Layout, num_blocks: int, pieces: list[tuple[HeadRange, ChunkBuffer, ChunkHeader]],
                allocate: Callable[[int], ChunkBuffer | None]) -> ChunkBuffer | None:
    """A chunk of ``num_blocks`` blocks of ``layout``'s heads in a fresh buffer of ``allocate(bytes)``,
    its payload joined from ``pieces`` (the heads each holds, its buffer, its header, already
    checked) and sealed with a KVSUM64. Each piece's payload is checked against its header's
    checksum: where the C library is built and the pieces carry KVSUM64s, in the same pass that
    copies their heads and sums the joined payload (each piece byte read once), else in a pass of
    its own first. Raises :class:`CorruptPiece` for the first piece that fails (the fresh buffer
    released); None when ``allocate`` has no room. The pieces stay the caller's to release."""
    payload = layout.payload_bytes(num_blocks)
    sizes = region_bytes(layout, num_blocks)
    heads = tuple(held for held, _, _ in pieces)
    sources = [piece.data[HEADER_BYTES : HEADER_BYTES + header.payload_bytes] for _, piece, header in pieces]
    one_pass = (cpu_library.available() and aligned(layout, heads, num_blocks)
                and all(s.numel() % 4 == 0 for s in sources)
                and all(header.checksum_kind == CHECKSUM_KVSUM64 for _, _, header in pieces))
    if not one_pass:
        for i, (source, (_, _, header)) in enumerate(zip(sources, pieces)):
            if checksum(source, header.checksum_kind) != header.checksum:
                raise CorruptPiece(i, "piece payload checksum mismatch (corrupt bytes)")
    built = allocate(HEADER_BYTES + payload)
    if built is None:
        return None
    dst = built.data[HEADER_BYTES : HEADER_BYTES + payload]
    if one_pass:  # copies the heads, sums what it writes and every byte of each piece
        kvsum, sums = join_checked(dst, sources, join_plan(layout.shard, sizes, heads))
        bad = next((i for i, (got, (_, _, header)) in enumerate(zip(sums, pieces)) if got != header.checksum), None)
        if bad is not None:
            built.release()
            raise CorruptPiece(bad, "piece payload kvsum64 checksum mismatch (corrupt bytes)")
        write_header(built.data, layout, num_blocks, kvsum64=kvsum)
    else:
        join_pieces(dst, layout.shard, sizes, list(zip(heads, sources)))
        write_header(built.data, layout, num_blocks, kind=CHECKSUM_KVSUM64)
    return built


def seal_split(parts: Sequence[Layout], num_blocks: int, piece: tuple[HeadRange, ChunkBuffer, ChunkHeader],
               allocate: Callable[[int], ChunkBuffer | None]) -> list[ChunkBuffer] | None:
    """Each of ``parts`` (layouts of KV heads that together are exactly the heads ``piece`` holds)
    as a chunk of ``num_blocks`` blocks in a fresh buffer of ``allocate(bytes)``, sealed with a
    KVSUM64, all cut from ``piece`` (its heads, buffer, header), which is checked whole once: where
    the C library is built and the piece carries a KVSUM64, in the one pass that reads each of its
    bytes once and sums every part; else in a pass of its own first. None when ``allocate`` has no
    room (nothing is kept then) or the parts' bytes are not the piece's. Raises
    :class:`CorruptPiece` (index 0) when the piece fails its checksum. The piece stays the caller's
    to release."""
    held, buffer, header = piece
    sizes = [region_bytes(part, num_blocks) for part in parts]
    if sum(part.payload_bytes(num_blocks) for part in parts) != header.payload_bytes:
        return None
    source = buffer.data[HEADER_BYTES : HEADER_BYTES + header.payload_bytes]
    plan = None
    if cpu_library.available() and header.checksum_kind == CHECKSUM_KVSUM64:
        try:
            plan = split_plan(tuple((part.shard, size) for part, size in zip(parts, sizes)), held)
        except ValueError:  # heads not in 4-byte words: the slow way
            plan = None
    if plan is None and checksum(source, header.checksum_kind) != header.checksum:
        raise CorruptPiece(0, "piece payload checksum mismatch (corrupt bytes)")
    built: list[ChunkBuffer] = []
    for part in parts:
        if (out := allocate(HEADER_BYTES + part.payload_bytes(num_blocks))) is None:
            for b in built:
                b.release()
            return None
        built.append(out)
    dsts = [b.data[HEADER_BYTES : HEADER_BYTES + part.payload_bytes(num_blocks)] for b, part in zip(built, parts)]
    if plan is None:
        for b, dst, part, size in zip(built, dsts, parts, sizes):
            join_pieces(dst, part.shard, size, [(held, source)])
            write_header(b.data, part, num_blocks, kind=CHECKSUM_KVSUM64)
        return built
    sums, whole = split_checked(dsts, source, plan)
    if whole != header.checksum:
        for b in built:
            b.release()
        raise CorruptPiece(0, "piece payload kvsum64 checksum mismatch (corrupt bytes)")
    for b, part, kvsum in zip(built, parts, sums):
        write_header(b.data, part, num_blocks, kvsum64=kvsum)
    return built
