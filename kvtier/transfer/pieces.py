"""A rank's chunk built from the pieces ranks of another TP size stored (see :mod:`kvtier.shards`).

When a load finds no chunk under the rank's own storage key, :func:`assemble` looks for the
pieces that hold its KV heads (at most one way per writer TP size of :data:`kvtier.shards.WRITER_TP_SIZES`;
in the local tiers first, then through ``store.get``, which reads the shared tier), checks each
piece's header, joins their heads into a chunk of the rank's layout (checking each piece's
checksum in the same pass, :func:`kvtier.codec.joined.seal_joined`) sealed with a KVSUM64, and
stores it under the rank's own key in the CPU tier (only there: the pieces stay the disk's and
the shared tier's copy), so that the next load finds it. A corrupt piece is removed and the chunk
counts as missing (recomputed).

Buffers: each piece's buffer comes from ``store.get`` and is released here; the built chunk goes to
``store.put``, and the buffer returned is a ``store.get`` of it, the caller's to release.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator, Sequence

from kvtier import codec
from kvtier.keys import storage_key
from kvtier.layout import Layout
from kvtier.codec.joined import CorruptPiece, seal_joined
from kvtier.shards import HeadRange, covers, piece_fingerprint, piece_layout
from kvtier.storage import ChunkBuffer, ChunkStore, Tier

logger = logging.getLogger(__name__)

_SLOWER = (Tier.CPU, Tier.DISK, Tier.SHARED)


def assemble(layout: Layout, store: ChunkStore, key: bytes, chunk_blocks: int,
             on_held: Callable[[list[bytes]], None]) -> ChunkBuffer | None:
    """Chain key ``key``'s chunk of ``chunk_blocks`` blocks for ``layout``'s heads, built from other
    TP sizes' pieces in ``store`` and stored under the rank's own key (``on_held`` hears of it);
    None when no way's pieces are all stored, one is corrupt (removed), or the CPU pool has no room."""
    ways = _ways(layout, key)
    if (held := _held_way(store, ways)) is not None:
        return _join(layout, store, key, chunk_blocks, on_held, *held)
    for way, skeys in ways:  # none whole in the local tiers: the shared tier's, read through store.get
        if (built := _join(layout, store, key, chunk_blocks, on_held, way, skeys)) is not None:
            return built
    return None


def to_read(layout: Layout, store: ChunkStore, keys: Sequence[bytes]) -> Iterator[bytes]:
    """Storage keys a load of chain keys ``keys`` reads, in order: for each, its own chunk where a
    local tier holds it, else the pieces :func:`assemble` would join (of the first way the local
    tiers hold whole), else its own key (none of it stored here). What a load names to its disk
    tier's read-ahead; lazy, so nothing is looked up where none is read."""
    for key in keys:
        own = storage_key(key, layout.fingerprint)
        held = None if store.contains(own) is not None else _held_way(store, _ways(layout, key))
        yield from [own] if held is None else held[1]


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
    return [(way, [storage_key(key, piece_fingerprint(shard.base, heads)) for heads in way])
            for way in covers(shard.first, shard.end, shard.total)]


def _join(layout: Layout, store: ChunkStore, key: bytes, chunk_blocks: int, on_held: Callable[[list[bytes]], None],
          way: tuple[HeadRange, ...], skeys: list[bytes]) -> ChunkBuffer | None:
    pieces: list[ChunkBuffer] = []
    headers: list[codec.ChunkHeader] = []
    try:
        for heads, skey in zip(way, skeys):
            piece = store.get(skey)
            if piece is None:
                return None
            pieces.append(piece)
            try:  # the header here; the payload's checksum as the join copies it
                headers.append(codec.verify_chunk(piece.data, piece_layout(layout, heads), chunk_blocks,  # type: ignore[arg-type]
                                                  payload=False))
            except codec.ChunkError as exc:
                return _unusable(store, key, skey, heads, exc)
        try:
            built = seal_joined(layout, chunk_blocks, list(zip(way, pieces, headers)),
                                lambda n: store.allocate(n, wait=False))
        except CorruptPiece as exc:
            return _unusable(store, key, skeys[exc.index], way[exc.index], exc)
        if built is None:
            return None
        tier = max((piece.tier for piece in pieces), key=_SLOWER.index)
    finally:
        for piece in pieces:
            piece.release()
    own = storage_key(key, layout.fingerprint)
    store.put([own], [built], cpu_only=True)  # the pieces stay the disk's and shared tier's copy: none twice
    on_held([own])
    buffer = store.get(own)
    if buffer is not None:
        buffer.tier = tier  # counted as a hit of the tier the pieces came from
    return buffer


def _unusable(store: ChunkStore, key: bytes, skey: bytes, heads: HeadRange, exc: Exception) -> None:
    """Remove stored piece ``skey`` (of chain key ``key``, KV ``heads``) that failed a check, and say so."""
    store.remove(skey)
    logger.warning("kvtier: stored piece %s (KV heads %d-%d) of chunk %s is unusable (%s); removed it and recomputing.",
                   skey.hex(), heads[0], heads[1], key.hex(), exc)
