"""A rank's chunk from the pieces ranks of another TP size stored (see :mod:`kvtier.shards`).

When a load finds no chunk under the rank's own storage key, :func:`take` gets the pieces that
hold its KV heads (at most one way per writer TP size of :data:`kvtier.shards.WRITER_TP_SIZES`; in
the local tiers first, then through ``store.get``, which reads the shared tier) and checks each
piece's header. On a CPU engine the load scatters them straight into its blocks, each piece
checked against its checksum as it is copied (:class:`kvtier.ops.span.PieceSpan`); elsewhere
:func:`assemble` joins their heads into a chunk of the rank's layout (checking each piece in the
same pass, :func:`kvtier.codec.joined.seal_joined`) sealed with a KVSUM64 and stores it under the
rank's own key in the CPU tier (only there: the pieces stay the disk's and the shared tier's
copy), so that the next load finds it. A corrupt piece is removed and the chunk counts as missing
(recomputed).

Buffers: each piece's buffer comes from ``store.get``; :class:`Taken` holds them for the caller to
release (:func:`assemble` releases them itself). The built chunk goes to ``store.put``, and the
buffer :func:`assemble` returns is a ``store.get`` of it, the caller's to release.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from kvtier import codec
from kvtier.keys import storage_key
from kvtier.layout import Layout
from kvtier.codec.joined import CorruptPiece, seal_joined
from kvtier.shards import HeadRange, covers, piece_fingerprint, piece_layout
from kvtier.storage import ChunkBuffer, ChunkStore, Tier

logger = logging.getLogger(__name__)

_SLOWER = (Tier.CPU, Tier.DISK, Tier.SHARED)


@dataclass(slots=True)
class Taken:
    """One chunk's pieces as :func:`take` got them: their heads (``way``), storage keys, buffers
    (the caller's to :meth:`release`) and checked headers (their payloads not checked yet)."""

    way: tuple[HeadRange, ...]
    skeys: list[bytes]
    buffers: list[ChunkBuffer]
    headers: list[codec.ChunkHeader]

    @property
    def tier(self) -> Tier:
        """The slowest tier a piece came from: the tier the chunk counts as a hit of."""
        return max((buffer.tier for buffer in self.buffers), key=_SLOWER.index)

    @property
    def kvsum64(self) -> bool:
        """Every piece is sealed with a KVSUM64, which a copy can check as it goes."""
        return all(header.checksum_kind == codec.KVSUM64 for header in self.headers)

    def release(self) -> None:
        for buffer in self.buffers:
            buffer.release()


def take(layout: Layout, store: ChunkStore, key: bytes, chunk_blocks: int) -> Taken | None:
    """Chain key ``key``'s pieces that hold ``layout``'s heads (of chunks of ``chunk_blocks`` blocks),
    their headers checked: the first way the local tiers hold whole, else the first whose pieces
    ``store.get`` finds (the shared tier's). None when none is whole; a piece whose header fails is
    removed."""
    ways = _ways(layout, key)
    held = _held_way(store, ways)
    for way, skeys in [held] if held is not None else ways:
        if (taken := _take_way(layout, store, key, chunk_blocks, way, skeys)) is not None:
            return taken
    return None


def assemble(layout: Layout, store: ChunkStore, key: bytes, chunk_blocks: int,
             on_held: Callable[[list[bytes]], None], taken: Taken | None = None) -> ChunkBuffer | None:
    """Chain key ``key``'s chunk of ``chunk_blocks`` blocks for ``layout``'s heads, built from other
    TP sizes' pieces in ``store`` (``taken``, released here; else :func:`take`'s) and stored under
    the rank's own key (``on_held`` hears of it); None when no way's pieces are all stored, one is
    corrupt (removed), or the CPU pool has no room."""
    taken = taken or take(layout, store, key, chunk_blocks)
    if taken is None:
        return None
    tier = taken.tier
    try:
        built = seal_joined(layout, chunk_blocks, list(zip(taken.way, taken.buffers, taken.headers)),
                            lambda n: store.allocate(n, wait=False))
    except CorruptPiece as exc:
        return unusable(layout, store, key, taken.way[exc.index], exc)
    finally:
        taken.release()
    if built is None:
        return None
    own = storage_key(key, layout.fingerprint)
    store.put([own], [built], cpu_only=True)  # the pieces stay the disk's and shared tier's copy: none twice
    on_held([own])
    buffer = store.get(own)
    if buffer is not None:
        buffer.tier = tier  # counted as a hit of the tier the pieces came from
    return buffer


def to_read(layout: Layout, store: ChunkStore, keys: Sequence[bytes]) -> Iterator[bytes]:
    """Storage keys a load of chain keys ``keys`` reads, in order: for each, its own chunk where a
    local tier holds it, else the pieces :func:`assemble` would join (of the first way the local
    tiers hold whole), else its own key (none of it stored here). What a load names to its disk
    tier's read-ahead; lazy, so nothing is looked up where none is read."""
    for key in keys:
        own = storage_key(key, layout.fingerprint)
        held = None if store.contains(own) is not None else _held_way(store, _ways(layout, key))
        yield from [own] if held is None else held[1]


def piece_keys(layout: Layout, key: bytes, way: Sequence[HeadRange]) -> list[bytes]:
    """The storage keys of chain key ``key``'s pieces of KV heads ``way`` (of ``layout``'s model)."""
    return [storage_key(key, piece_fingerprint(layout.shard.base, heads)) for heads in way]


def _held_way(store: ChunkStore, ways: list[tuple[tuple[HeadRange, ...], list[bytes]]]
              ) -> tuple[tuple[HeadRange, ...], list[bytes]] | None:
    """The first of ``ways`` whose pieces the local tiers (CPU, disk) hold whole, or None."""
    return next(((way, skeys) for way, skeys in ways if all(store.contains(s) is not None for s in skeys)), None)


def _ways(layout: Layout, key: bytes) -> list[tuple[tuple[HeadRange, ...], list[bytes]]]:
    """Every way of covering the rank's heads with other TP sizes' pieces, with the pieces' storage
    keys for chain key ``key``; none for a layout without a head dim (one piece for every rank)."""
    shard = layout.shard
    if shard is None or shard.replicated:
        return []
    return [(way, piece_keys(layout, key, way)) for way in covers(shard.first, shard.end, shard.total)]


def _take_way(layout: Layout, store: ChunkStore, key: bytes, chunk_blocks: int, way: tuple[HeadRange, ...],
              skeys: list[bytes]) -> Taken | None:
    taken = Taken(way, skeys, [], [])
    for heads, skey in zip(way, skeys):
        piece = store.get(skey)
        if piece is None:
            taken.release()
            return None
        taken.buffers.append(piece)
        try:  # the header here; the payload's checksum as it is copied
            taken.headers.append(codec.verify_chunk(piece.data, piece_layout(layout, heads), chunk_blocks,  # type: ignore[arg-type]
                                                    payload=False))
        except codec.ChunkError as exc:
            taken.release()
            return unusable(layout, store, key, heads, exc)
    return taken


def unusable(layout: Layout, store: ChunkStore, key: bytes, heads: HeadRange, problem: object) -> None:
    """Remove chain key ``key``'s stored piece of KV ``heads`` (another TP size's, for ``layout``'s
    heads), which failed a check (``problem``), and say so."""
    skey = storage_key(key, piece_fingerprint(layout.shard.base, heads))
    store.remove(skey)
    logger.warning("kvtier: stored piece %s (KV heads %d-%d) of chunk %s is unusable (%s); removed it and recomputing.",
                   skey.hex(), heads[0], heads[1], key.hex(), problem)
