"""A stored chunk cut down to the KV heads of a decode rank of a larger TP size (:mod:`kvtier.shards`).

A decode engine of more TP ranks than this producer's reads each of this rank's chunks from
several ranks, each wanting only its own heads: its hello names the piece fingerprint of those
heads (inside this rank's). The chunk server cuts them out of the stored chunk, checking the stored
chunk's KVSUM64 in the same pass that copies them (:func:`kvtier.codec.joined.seal_joined`: a
corrupt stored chunk is never sealed anew), and seals the cut under the decode rank's fingerprint.
Each decode rank then gets its share of the bytes, not the whole chunk, and loads it as its own.
The other ranks' cuts of a copy checked so read only their own heads (:class:`Cutter`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict

from kvtier import codec
from kvtier.codec.joined import seal_joined
from kvtier.layout import Layout
from kvtier.pd.protocol import Hello
from kvtier.shards import HeadRange, HeadShard, piece_fingerprint, rank_heads
from kvtier.storage import ChunkBuffer, ChunkStore

logger = logging.getLogger(__name__)

CHECKED_KEPT = 64  # stored chunks a Cutter holds, checked whole, for the other ranks' cuts
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
class _Held:
    """A stored chunk a :class:`Cutter` checked whole and holds for the other ranks' cuts."""

    buffer: ChunkBuffer  # one reference of the stored chunk, the Cutter's
    cuts_left: int  # cuts of it still to come
    since_s: float  # when it was first cut (time.monotonic)


class Cutter:
    """A chunk server's cuts, from ``store``'s chunks. A stored chunk that the first decode rank's
    cut checked whole stays held here (one reference: its memory can be neither freed nor used for
    another chunk meanwhile) until the other ranks reading this rank's heads cut it too, each
    reading only its own heads; at most :data:`CHECKED_KEPT` are held, each for :data:`HELD_S` at
    most (the oldest let go first: a chunk held is one the CPU tier cannot evict meanwhile)."""

    def __init__(self, store: ChunkStore):
        self._store = store
        self._checked: OrderedDict[tuple[bytes, int, int], _Held] = OrderedDict()  # by (key, address, checksum)
        self.total = 0  # chunks cut
        self.checked_once = 0  # of those, cut from a copy held here, checked by an earlier cut
        self.seconds = 0.0  # spent cutting (and checking) since start, on the calling thread

    def cut(self, buffer: ChunkBuffer, skey: bytes, layout: Layout, to: HeadSlice, what: str) -> ChunkBuffer | None:
        """``buffer``'s chunk (stored under ``skey``, of ``layout``) cut to ``to``'s heads, in a fresh
        buffer from the store. Takes ``buffer``; None when there is no room, or the stored chunk is
        unusable (removed from the store then, and said for ``what``, the chunk's name in the line)."""
        keep, start = False, time.perf_counter()
        try:
            header = codec.read_header(buffer.data)
            unit = sum(layout.token_bytes) if to.per_token else layout.bytes_per_block
            units = header.tokens if to.per_token else header.payload_bytes // unit
            if header.fingerprint != layout.fingerprint or not units or header.payload_bytes != units * unit:
                raise codec.ChunkError("its header does not match this rank's layout")
            copy = (skey, buffer.data.data_ptr(), header.checksum)
            held = self._checked.get(copy)
            out = seal_joined(to, units, [((layout.shard.first, layout.shard.end), buffer, header)],
                              lambda n: self._store.allocate(n, wait=False), checked=held is not None)
            if out is None:
                return None
            self.total += 1
            if held is not None:
                self.checked_once += 1
                held.cuts_left -= 1
                if held.cuts_left <= 0:
                    self._checked.pop(copy).buffer.release()
            elif (left := layout.shard.heads // to.shard.heads - 1) > 0:
                self._checked[copy], keep = _Held(buffer, left, time.monotonic()), True
            self.expire()
            return out
        except codec.ChunkError as exc:  # a CorruptPiece too: a flipped byte in the stored copy
            self._store.remove(skey)
            logger.warning("kvtier P/D chunk server: %s is unusable (%s); removed it and answered missing.", what, exc)
            return None
        finally:
            if not keep:
                buffer.release()
            self.seconds += time.perf_counter() - start

    def expire(self) -> None:
        """Let go of the chunks held longest, past :data:`HELD_S` or beyond :data:`CHECKED_KEPT`."""
        now = time.monotonic()
        while self._checked:
            oldest = next(iter(self._checked.values()))
            if len(self._checked) <= CHECKED_KEPT and now - oldest.since_s <= HELD_S:
                break
            self._checked.popitem(last=False)
            oldest.buffer.release()

    def close(self) -> None:
        """Let go of every chunk held."""
        while self._checked:
            self._checked.popitem()[1].buffer.release()
