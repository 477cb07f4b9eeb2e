"""A decode engine rank's chunks from a producer of another TP size (:mod:`kvtier.shards`).

Rank ``r`` of a decode engine of ``t`` ranks holds KV heads ``[r * H / t, (r + 1) * H / t)``; rank
``p`` of a producer of ``s`` ranks serves its chunks as pieces of heads ``[p * H / s, (p + 1) * H / s)``.
:func:`producer_pieces` names the producer ranks whose pieces hold this rank's heads: one wider piece
when ``s < t`` (several of this engine's ranks read it: :mod:`kvtier.pd.producer.handshakes`), which
cuts this rank's heads out of its chunks and seals them under this rank's fingerprint
(:mod:`kvtier.pd.producer.slicing`): they come as this rank's own chunks. Several narrower ones when
``s > t``. :func:`gather_chunks` fetches each piece over its own connection
(each hello names the piece's fingerprint, which the producer rank's chunks are sealed under) and
checks each piece's header. Narrower pieces that together hold exactly this rank's heads go on as
they came (:class:`Gathered`) where the consumer scatters them into its blocks itself, each checked
against its KVSUM64 as it is copied (a CPU engine: :class:`kvtier.ops.span.PieceSpan`), and are kept
in its CPU tier as pieces, as another TP size's rank stored them. Else their heads are joined into
a chunk of this rank's layout, each piece checked as it is copied, sealed anew (:class:`Joined`).

Pieces travel into this engine's CPU tier (ZMQ, or NIXL READs into its pool), never straight into
engine blocks: a block of the producer's holds other heads than this engine's. A layout without a
head dim (MLA's latent cache) is the same on every rank: rank ``r`` reads producer rank ``r mod s``'s
chunks as they are, over any route (:func:`producer_pieces` gives its heads as None).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import msgspec

from kvtier import codec
from kvtier.codec.joined import CorruptPiece, seal_joined
from kvtier.jobs import Landed
from kvtier.layout import Layout
from kvtier.ops.cpu_pieces import aligned
from kvtier.pd.consumer.connection import Consumer, FetchSpec
from kvtier.pd.consumer.fetch import fetch_chunks
from kvtier.pd.consumer.hello import PeerError
from kvtier.shards import HeadRange, piece_fingerprint, piece_layout, rank_heads
from kvtier.storage import ChunkBuffer


@dataclasses.dataclass(frozen=True, slots=True)
class Joined:
    """A chunk :func:`gather_chunks` joined from pieces it verified, and sealed itself: its payload
    needs no second check. ``buffer``: the caller's to release or store."""

    buffer: ChunkBuffer


@dataclasses.dataclass(frozen=True, slots=True)
class Gathered:
    """A chunk's pieces as :func:`gather_chunks` got them, in head order, together holding exactly
    this rank's heads: the heads each holds (``way``), the chunk server each came from, their buffers
    (the caller's to release or store) and their headers (checked; the payloads not yet: each is
    checked against its KVSUM64 as it is scattered)."""

    way: tuple[HeadRange, ...]
    endpoints: tuple[str, ...]
    buffers: tuple[ChunkBuffer, ...]
    headers: tuple[codec.ChunkHeader, ...]

    def release(self) -> None:
        for buffer in self.buffers:
            buffer.release()


def producer_pieces(layout: Layout, producers: int, rank: int, tp_size: int) -> list[tuple[int, HeadRange | None]]:
    """The producer ranks (of ``producers``) rank ``rank`` of ``tp_size`` (``layout``'s) reads, each with
    the heads its piece holds (None: the producer's chunks are this rank's as they are). Raises
    :class:`PeerError` when the producer's ranks cannot be mapped to this rank's heads."""
    shard = layout.shard
    if shard is None:
        raise PeerError(f"the producer has {producers} TP ranks, this engine {tp_size}, and this engine's "
                        f"chunks are per TP rank ({layout.description})")
    if shard.replicated:
        return [(rank % producers, None)]
    if shard.total % producers:
        raise PeerError(f"the producer's {producers} TP ranks do not split this model's {shard.total} KV heads")
    held = [(p, rank_heads(shard.total, p, producers)) for p in range(producers)]
    return [(p, heads) for p, heads in held if heads[0] < shard.end and shard.first < heads[1]]


def fetch_any_tp(consumer: Consumer, layout: Layout, endpoints: tuple[str, ...], spec: FetchSpec,
                 allocate: Callable[[int], ChunkBuffer | None], scatters_pieces: bool = False,
                 ) -> Iterator[ChunkBuffer | Landed | Joined | Gathered]:
    """:func:`~kvtier.pd.consumer.fetch.fetch_chunks` of ``spec`` (its endpoint unused) from a producer
    whose ranks' chunk servers are ``endpoints``, any number of them: this rank's own producer rank's
    when they are as many as this engine's ranks, else :func:`gather_chunks`'s (raises
    :class:`PeerError` when its ranks cannot be mapped to this rank's heads). ``scatters_pieces``:
    the consumer scatters :class:`Gathered` pieces itself, checking each as it copies it."""
    rank, tp_size = consumer.hello.rank, consumer.hello.tp_size
    if len(endpoints) == tp_size:
        return fetch_chunks(consumer, dataclasses.replace(spec, endpoint=endpoints[rank]))
    pieces = producer_pieces(layout, len(endpoints), rank, tp_size)
    if pieces[0][1] is None:  # the same KV on every rank: the producer rank's chunks as they are
        return fetch_chunks(consumer, dataclasses.replace(spec, endpoint=endpoints[pieces[0][0]]))
    if len(pieces) == 1 and len(endpoints) < tp_size:  # one producer rank holds these heads and more: it
        # sends this rank's part, sealed under this rank's fingerprint (kvtier.pd.producer.slicing), from its CPU tier
        return fetch_chunks(consumer, dataclasses.replace(spec, endpoint=endpoints[pieces[0][0]], landing=None,
                                                          producer_blocks=()))
    return gather_chunks(consumer, layout, [(endpoints[p], heads) for p, heads in pieces], spec, allocate,
                         scatters_pieces)


def gather_chunks(consumer: Consumer, layout: Layout, pieces: list[tuple[str, HeadRange]], spec: FetchSpec,
                  allocate: Callable[[int], ChunkBuffer | None], scatters_pieces: bool = False,
                  ) -> Iterator[Joined | Gathered]:
    """Yield the chunks of ``spec`` (its endpoint unused) for ``layout``'s heads from ``pieces`` (a
    producer rank's chunk server, the heads its piece holds): as :class:`Gathered` where
    ``scatters_pieces`` and the pieces hold exactly these heads in KVSUM64-sealed 4-byte words, else
    joined into a fresh buffer of ``allocate`` the caller owns (as :class:`Joined`). Raises
    :class:`PeerError` (after the chunks that did arrive) when a piece fails or is unusable."""
    shard = layout.shard
    exact = pieces[0][1][0] == shard.first and pieces[-1][1][1] == shard.end  # no piece wider than these heads
    way = tuple(heads for _, heads in pieces)
    streams: list[tuple[HeadRange, str, Iterator[ChunkBuffer]]] = []
    for endpoint, heads in pieces:
        held = piece_layout(layout, heads)
        shaped = dataclasses.replace(
            consumer, hello=msgspec.structs.replace(consumer.hello, fingerprint=piece_fingerprint(shard.base, heads)),
            chunk_bytes=lambda n, held=held: codec.HEADER_BYTES + held.payload_bytes(n))
        piece_spec = dataclasses.replace(spec, endpoint=endpoint, landing=None, producer_blocks=())
        streams.append((heads, endpoint, fetch_chunks(shaped, piece_spec)))  # type: ignore[arg-type]
    try:
        for index, (_, num_blocks) in enumerate(spec.items):
            arrived: list[tuple[HeadRange, ChunkBuffer]] = []
            headers: list[codec.ChunkHeader] = []
            try:
                for heads, endpoint, stream in streams:
                    piece = next(stream)  # fetch_chunks yields every chunk or raises
                    arrived.append((heads, piece))
                    try:  # the header here; the payload's checksum as the join copies it
                        headers.append(codec.verify_chunk(piece.data, piece_layout(layout, heads),  # type: ignore[arg-type]
                                                          num_blocks, payload=False))
                    except codec.ChunkError as exc:
                        raise _unusable(endpoint, index, heads, exc) from exc
                if (scatters_pieces and exact and aligned(layout, way, num_blocks)
                        and all(h.checksum_kind == codec.KVSUM64 for h in headers)):
                    gathered = Gathered(way, tuple(e for _, e, _ in streams), tuple(p for _, p in arrived),
                                        tuple(headers))
                    arrived = []  # the caller's now
                    yield gathered
                    continue
                try:
                    built = seal_joined(layout, num_blocks, [(h, p, hd) for (h, p), hd in zip(arrived, headers)], allocate)
                except CorruptPiece as exc:
                    heads, endpoint, _ = streams[exc.index]
                    raise _unusable(endpoint, index, heads, exc) from exc
                if built is None:
                    raise PeerError(f"no room in this engine's CPU tier for chunk {index}")
            finally:
                for _, piece in arrived:
                    piece.release()
            yield Joined(built)
    finally:
        for _, _, stream in streams:
            stream.close()  # each producer rank is told it is done


def _unusable(endpoint: str, index: int, heads: HeadRange, exc: Exception) -> PeerError:
    return PeerError(f"{endpoint} sent chunk {index}'s piece of KV heads {heads[0]}-{heads[1]} unusable ({exc})")
