"""A stored chunk cut down to the KV heads of a decode rank of a larger TP size (:mod:`kvtier.shards`).

A decode engine of more TP ranks than this producer's reads each of this rank's chunks from
several ranks, each wanting only its own heads: its hello names the piece fingerprint of those
heads (inside this rank's). The chunk server cuts them out of the stored chunk and seals each
under its decode rank's fingerprint, checking the stored chunk's KVSUM64 in the same pass (a
corrupt stored chunk is never sealed anew). The first decode rank's fetch of a chunk cuts every
decode rank's part in that one pass (:func:`kvtier.codec.joined.seal_split`, each stored byte
read once); the other ranks' parts wait in the :class:`Cutter` for their fetches. Each decode
rank then gets its share of the bytes, not the whole chunk, and loads it as its own.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict

from kvtier import codec
from kvtier.codec.joined import seal_joined, seal_split
from kvtier.layout import Layout
from kvtier.pd.protocol import Hello
from kvtier.shards import HeadRange, HeadShard, piece_fingerprint, rank_heads
from kvtier.storage import ChunkBuffer, ChunkStore

logger = logging.getLogger(__name__)

PARTS_KEPT = 64  # parts cut ahead that a Cutter holds for the other decode ranks' fetches
HELD_S = 2.0  # how long at most it holds one (the other ranks' fetches of a chunk come together)


@dataclasses.dataclass(frozen=True, slots=True)
class _Region:
    block_bytes: int  # bytes of one unit (a block, or a token of a token-contiguous layout)


@dataclasses.dataclass(frozen=True, slots=True)
class HeadSlice:
    """What :func:`~kvtier.codec.joined.seal_joined` reads of the decode rank's layout: its heads
    (``shard``), the fingerprint its chunks are sealed under, and the bytes of one unit of each
    region. A unit is a block, or one token where the producer's layout is token-contiguous (a
    prompt's tail re-cut to the decode engine's block size holds any number of tokens)."""

    regions: tuple[_Region, ...]
    block_size: int  # tokens per unit
    fingerprint: bytes
    shard: HeadShard
    per_token: bool

    def payload_bytes(self, units: int) -> int:
        return units * sum(r.block_bytes for r in self.regions)


def head_slice(layout: Layout, heads: HeadRange) -> HeadSlice | None:
    """The slice of ``layout``'s chunks holding ``heads``, a proper part of the heads its rank
    holds; None when its chunks are not keyed by heads or ``heads`` is not such a part."""
    shard = layout.shard
    if shard is None or shard.replicated or not shard.first <= heads[0] < heads[1] <= shard.end:
        return None
    if heads == (shard.first, shard.end):
        return None
    held = heads[1] - heads[0]
    per_token = layout.token_contiguous
    sizes = layout.token_bytes if per_token else tuple(r.block_bytes for r in layout.regions)
    regions = tuple(_Region(size * held // shard.heads) for size in sizes)
    return HeadSlice(regions, 1 if per_token else layout.block_size, piece_fingerprint(shard.base, heads),
                     dataclasses.replace(shard, first=heads[0], end=heads[1]), per_token)


def rank_part(layout: Layout | None, tp_size: int, hello: Hello) -> HeadSlice | None:
    """The part of the heads of this rank (``layout``, None: not keyed by heads; of ``tp_size``) that
    ``hello``'s decode rank of a larger TP size holds, when its hello names that part's fingerprint;
    else None."""
    shard = layout.shard if layout is not None else None
    if shard is None or shard.replicated or hello.tp_size <= tp_size or shard.total % hello.tp_size:
        return None
    part = head_slice(layout, rank_heads(shard.total, hello.rank, hello.tp_size))
    return part if part is not None and part.fingerprint == hello.fingerprint else None


@dataclasses.dataclass(slots=True)
class _Ahead:
    """A decode rank's part of a stored chunk, cut and sealed with an earlier rank's, not yet fetched."""

    buffer: ChunkBuffer  # its own buffer from the store, the Cutter's until fetched
    since_s: float  # when it was cut (time.monotonic)


class Cutter:
    """A chunk server's cuts, from ``store``'s chunks. The first decode rank's cut of a stored chunk
    cuts the other decode ranks' parts of this rank's heads too, in the same pass; each waits here
    for its rank's fetch of that copy (the same key, address and checksum), at most
    :data:`PARTS_KEPT` of them, each for :data:`HELD_S` at most (the oldest let go first: a part
    held is pool memory the CPU tier cannot use meanwhile). Without room for every part, each cut
    is a pass of its own, checking the stored chunk whole each time."""

    def __init__(self, store: ChunkStore):
        self._store = store
        # by (key, address, checksum) of the stored copy, and the part's first and end head
        self._ahead: OrderedDict[tuple[bytes, int, int, int, int], _Ahead] = OrderedDict()
        self.total = 0  # chunks cut
        self.cut_ahead = 0  # of those, answered with a part cut in an earlier rank's pass
        self.seconds = 0.0  # spent cutting (and checking) since start, on the calling thread

    def cut(self, buffer: ChunkBuffer, skey: bytes, layout: Layout, to: HeadSlice, what: str) -> ChunkBuffer | None:
        """``buffer``'s chunk (stored under ``skey``, of ``layout``) cut to ``to``'s heads, in a fresh
        buffer from the store. Takes ``buffer``; None when there is no room, or the stored chunk is
        unusable (removed from the store then, and said for ``what``, the chunk's name in the line)."""
        start = time.perf_counter()
        try:
            header = codec.read_header(buffer.data)
            copy = (skey, buffer.data.data_ptr(), header.checksum)
            if (ahead := self._ahead.pop((*copy, to.shard.first, to.shard.end), None)) is not None:
                self.total += 1
                self.cut_ahead += 1
                return ahead.buffer
            unit = sum(layout.token_bytes) if to.per_token else layout.bytes_per_block
            units = header.tokens if to.per_token else header.payload_bytes // unit
            if header.fingerprint != layout.fingerprint or not units or header.payload_bytes != units * unit:
                raise codec.ChunkError("its header does not match this rank's layout")
            mine = (layout.shard.first, layout.shard.end)
            out = self._cut_every_part(buffer, header, copy, layout, to, units)
            if out is None:
                out = seal_joined(to, units, [(mine, buffer, header)], lambda n: self._store.allocate(n, wait=False))
            if out is not None:
                self.total += 1
            self.expire()
            return out
        except codec.ChunkError as exc:  # a CorruptPiece too: a flipped byte in the stored copy
            self._store.remove(skey)
            logger.warning("kvtier P/D chunk server: %s is unusable (%s); removed it and answered missing.", what, exc)
            return None
        finally:
            buffer.release()
            self.seconds += time.perf_counter() - start

    def _cut_every_part(self, buffer: ChunkBuffer, header: codec.ChunkHeader, copy: tuple[bytes, int, int],
                        layout: Layout, to: HeadSlice, units: int) -> ChunkBuffer | None:
        """``to``'s part, with every other part of ``to``'s width of this rank's heads cut in the same
        pass and kept for their ranks; None where that pass does not apply."""
        shard, width = layout.shard, to.shard.heads
        if (to.shard.first - shard.first) % width or shard.heads % width:
            return None
        parts = [to if first == to.shard.first else head_slice(layout, (first, first + width))
                 for first in range(shard.first, shard.end, width)]
        if any(part is None for part in parts):
            return None
        cuts = seal_split(parts, units, ((shard.first, shard.end), buffer, header),
                          lambda n: self._store.allocate(n, wait=False))
        if cuts is None:
            return None
        now, out = time.monotonic(), None
        for part, cut in zip(parts, cuts):
            if part is to:
                out = cut
                continue
            key = (*copy, part.shard.first, part.shard.end)
            if (earlier := self._ahead.pop(key, None)) is not None:  # the same chunk cut again before its rank came
                earlier.buffer.release()
            self._ahead[key] = _Ahead(cut, now)
        return out

    def expire(self) -> None:
        """Let go of the parts held longest, past :data:`HELD_S` or beyond :data:`PARTS_KEPT`."""
        now = time.monotonic()
        while self._ahead:
            oldest = next(iter(self._ahead.values()))
            if len(self._ahead) <= PARTS_KEPT and now - oldest.since_s <= HELD_S:
                break
            self._ahead.popitem(last=False)
            oldest.buffer.release()

    def close(self) -> None:
        """Let go of every part held."""
        while self._ahead:
            self._ahead.popitem()[1].buffer.release()
