"""Chunks any TP size reads: each rank's piece of a chunk is named by the KV heads it holds.

Tensor parallelism splits a model's ``total`` KV heads evenly: rank ``r`` of ``t`` holds heads
``[r * total / t, (r + 1) * total / t)``. A rank's piece of a chunk is stored under the chain key
bound to a *piece fingerprint*: the layout's TP-independent *base* fingerprint (model, dtype, block
shape with the head dim's size left out, total heads) and the head range. A rank whose exact piece
is missing builds it from the pieces that writers of another TP size stored (:func:`covers`: one
piece holding more heads, or several holding fewer), slicing and joining them along the head dim
of each region (:func:`join_pieces`).

Inside a block the head dim sits anywhere (vLLM-CPU ``[kv_heads, block_size, 2*head_size]``: heads
outermost; flash NHD ``[block_size, kv_heads, head_size]``; HND ``[kv_heads, block_size,
head_size]``; FlashInfer ``[2, block_size, kv_heads, head_size]``): a block is ``runs`` runs of
``kv_heads`` head slices of ``head_bytes`` bytes each, so a region's ``n`` blocks are ``n * runs``
such runs whatever the TP size. A layout without a head dim (MLA's latent cache) is the same on
every rank: it has one key for every rank and TP size (:attr:`HeadShard.replicated`).

Writers are looked for at TP sizes :data:`WRITER_TP_SIZES` that divide ``total``: a bounded set of
keys per chunk, never a search.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

WRITER_TP_SIZES = (1, 2, 4, 8)  # TP sizes whose pieces a reader looks for

HeadRange = tuple[int, int]  # [first, end) of the model's KV heads


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The KV heads one rank's blocks hold, in every region.

    ``base``: the layout's TP-independent fingerprint (16 bytes). ``first``, ``end``: the heads held,
    of ``total``; ``total`` 0 when the layout has no head dim (every rank holds the same KV).
    ``head_bytes``: per region, bytes of one head's slice within one run of heads (see the module
    docstring); empty when replicated.
    """

    base: bytes
    first: int
    end: int
    total: int
    head_bytes: tuple[int, ...] = ()

    @property
    def replicated(self) -> bool:
        """Every rank holds the same KV: one piece, stored once, read by every rank."""
        return self.total == 0

    @property
    def heads(self) -> int:
        return self.end - self.first


@functools.lru_cache(maxsize=256)
def piece_fingerprint(base: bytes, heads: HeadRange | None) -> bytes:
    """The fingerprint a piece holding ``heads`` is stored and sealed under (16 bytes); ``base``
    itself when ``heads`` is None (a layout without a head dim)."""
    if heads is None:
        return base
    return hashlib.blake2b(base + b"heads" + heads[0].to_bytes(4, "little") + heads[1].to_bytes(4, "little"),
                           digest_size=len(base)).digest()


@dataclass(frozen=True, slots=True)
class PieceLayout:
    """What :func:`kvtier.codec.verify_chunk` checks a piece against: its fingerprint, the reader's
    block size, and the bytes one block of the piece holds (the reader's times its share of heads)."""

    fingerprint: bytes
    block_size: int
    bytes_per_block: int

    def payload_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block


def piece_layout(layout: Any, heads: HeadRange) -> PieceLayout:
    """The piece holding ``heads`` as ``layout``'s rank (a :class:`~kvtier.layout.Layout` with ``shard``
    set) would read it."""
    shard = layout.shard
    per_block = layout.bytes_per_block * (heads[1] - heads[0]) // shard.heads
    return PieceLayout(piece_fingerprint(shard.base, heads), layout.block_size, per_block)


def rank_heads(total: int, tp_rank: int, tp_size: int) -> HeadRange:
    """Heads ``[first, end)`` rank ``tp_rank`` of ``tp_size`` holds (``total`` divisible by ``tp_size``)."""
    per = total // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def covers(first: int, end: int, total: int) -> list[tuple[HeadRange, ...]]:
    """Ways to build heads ``[first, end)`` from pieces of writers of other TP sizes: each a tuple of
    the pieces' head ranges in head order, fewest pieces first (at most ``len(WRITER_TP_SIZES)``).
    ``[first, end)`` itself is never among them."""
    found = []
    for size in WRITER_TP_SIZES:
        if total % size:
            continue
        per = total // size
        pieces = tuple((h, h + per) for h in range(first - first % per, end, per))
        if pieces != ((first, end),):
            found.append(pieces)
    return sorted(found, key=len)


def head_dim(block: torch.Tensor, kv_heads: int) -> int | str:
    """The dim of ``block`` (dim 0 indexes blocks, each block one dense range of bytes) that indexes
    KV heads, from its size ``kv_heads``; the reason as a str when no dim or several dims could be
    it (then the layout is stored per rank). The last dim (head size, or K and V of vLLM-CPU's
    ``2*head_size``) never is, nor, beside another candidate, the outermost dim of a
    ``[2, block_size, kv_heads, head_size]`` block in any order (K and V: FlashInfer's, and vLLM
    0.33's flash layout, where two KV heads a rank would otherwise look like it)."""
    dims = [d for d in range(1, block.dim() - 1) if block.shape[d] == kv_heads]
    if len(dims) > 1 and block.dim() == 5 and block.shape[1] == 2 and block.stride(1) == max(block.stride()[1:]):
        dims.remove(1)
    if len(dims) != 1:
        return (f"{len(dims)} dims of its block {tuple(block.shape[1:])} have {kv_heads} entries, the KV heads "
                f"per rank") if dims else f"its block {tuple(block.shape[1:])} has no dim of {kv_heads} KV heads"
    return dims[0]


def head_bytes(block: torch.Tensor, dim: int, block_bytes: int) -> int | str:
    """Bytes of one head's slice in a run of heads of ``block``'s head dim ``dim``: the dims inside
    it in memory, packed densely; the reason as a str when the block is not whole runs of heads."""
    size = block.stride(dim) * block.element_size()
    if size <= 0 or block_bytes % (size * block.shape[dim]):
        return f"its block of {block_bytes} B is not whole runs of {block.shape[dim]} heads of {size} B"
    return size


def memory_order(block: torch.Tensor, d: int) -> tuple[int, bool, int]:
    """Sort key of ``block``'s dim ``d`` by where it lies in memory, outermost first. A dim of one
    entry (one KV head a rank) has the stride of the dim it sits inside of in memory: vLLM 0.33's
    ``[kv_heads, block_size, 2*head_size]`` view over ``[block_size, kv_heads, ...]`` memory gives
    heads and tokens one stride at one head a rank, and the tokens are outer."""
    return -block.stride(d), block.shape[d] == 1, d


def independent_text(block: torch.Tensor, dim: int | None, token_dim: int | None) -> str:
    """``block``'s dims in memory order (outermost first) with the head dim as ``h`` and the token
    dim as ``t`` when given: what a TP-independent fingerprint covers of one region."""
    order = sorted((d for d in range(1, block.dim()) if block.shape[d] > 1 or d == dim),
                   key=lambda d: memory_order(block, d))
    return ",".join("h" if d == dim else "t" if d == token_dim else str(block.shape[d]) for d in order)


@functools.lru_cache(maxsize=64)
def join_plan(shard: HeadShard, region_bytes: tuple[int, ...], pieces: tuple[HeadRange, ...]) -> np.ndarray:
    """How :func:`join_pieces` fills a payload, as contiguous copies: ``int64 [copies, 4]``, each
    (piece index, byte offset in that piece's payload, byte offset in the joined payload, bytes),
    for pieces holding heads ``pieces`` (same arguments as :func:`join_pieces`). Together the
    copies write every byte of the joined payload once. The same for every chunk of a load (kept:
    read-only)."""
    rows = []
    at_dst, at_src = 0, [0] * len(pieces)
    for size, hb in zip(region_bytes, shard.head_bytes):
        runs = np.arange(size // (shard.heads * hb), dtype=np.int64)
        for i, (first, end) in enumerate(pieces):
            held = end - first
            lo, hi = max(first, shard.first), min(end, shard.end)
            if lo < hi:
                rows.append(np.stack([np.full(runs.size, i, dtype=np.int64),
                                      at_src[i] + runs * held * hb + (lo - first) * hb,
                                      at_dst + runs * shard.heads * hb + (lo - shard.first) * hb,
                                      np.full(runs.size, (hi - lo) * hb, dtype=np.int64)], axis=1))
            at_src[i] += runs.size * held * hb
        at_dst += size
    plan = np.concatenate(rows) if rows else np.zeros((0, 4), dtype=np.int64)
    plan.setflags(write=False)
    return plan


def join_pieces(dst: torch.Tensor, shard: HeadShard, region_bytes: tuple[int, ...],
                pieces: list[tuple[HeadRange, torch.Tensor]]) -> None:
    """Fill ``dst``, a chunk payload for ``shard``'s heads, from other ranks' piece payloads.

    ``dst``: ``uint8 [sum(region_bytes)]``, CPU: region-major, region ``i`` ``region_bytes[i]`` bytes
    (``n`` blocks of the reader's). ``pieces``: (head range, ``uint8`` payload), each payload the same
    blocks region-major with ``region_bytes[i] * heads / shard.heads`` bytes in region ``i``;
    together they hold every head of ``shard``. Payloads must be verified already.
    """
    # numpy's strided copies: one thread, no per-copy thread-pool dispatch (torch's strided copy_ of
    # these many small runs was ~10 x slower with 2 threads, and far slower beside a busy core)
    whole = dst.numpy()
    sources = [payload.numpy() for _, payload in pieces]
    at_dst = 0
    at_src = [0] * len(pieces)
    for size, hb in zip(region_bytes, shard.head_bytes):
        runs = size // (shard.heads * hb)
        out = whole[at_dst : at_dst + size].reshape(runs, shard.heads, hb)
        for i, (first, end) in enumerate(heads for heads, _ in pieces):
            held = end - first
            src = sources[i][at_src[i] : at_src[i] + runs * held * hb].reshape(runs, held, hb)
            lo, hi = max(first, shard.first), min(end, shard.end)
            if lo < hi:
                np.copyto(out[:, lo - shard.first : hi - shard.first], src[:, lo - first : hi - first])
            at_src[i] += runs * held * hb
        at_dst += size
