"""Host copies of pieces other TP sizes' ranks stored (:mod:`kvtier.shards`), each checked against its
own KVSUM64 in the pass that copies it (``kvt_copy`` / ``kvt_copy2`` of :mod:`kvtier.ops.cpu_library`).

* :func:`join_checked` joins pieces into a chunk of the reader's heads, summing the joined chunk
  as it writes it (its seal) and each piece at its own places (its check).
* :func:`split_checked` is the other way round: one piece cut into several destinations (each a
  decode rank's part of its heads), each summed as it is written (its seal) and the piece at its
  own places (its check).
* :func:`piece_units` is what :func:`kvtier.ops.cpu_ops.scatter` does with a
  :class:`~kvtier.ops.span.PieceSpan`: each piece's heads of the engine's go straight into the
  engine's blocks, no joined chunk in between, the piece checked as it is copied.

Either way every byte of a piece is read once and summed, the bytes of heads the reader does not
hold included (a piece wider than the reader's share): a piece with one flipped byte anywhere fails.
Offsets and sizes are multiples of 4 bytes (:func:`aligned`).
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch

from kvtier.codec.geometry import HEADER_BYTES, region_bytes
from kvtier.layout import Layout
from kvtier.ops.cpu_library import BYTES_PER_THREAD, default_threads, loaded
from kvtier.ops.span import PieceSpan
from kvtier.shards import HeadRange, HeadShard, join_plan, piece_layout


def aligned(layout: Layout, heads: Sequence[HeadRange], num_blocks: int) -> bool:
    """Whether pieces holding ``heads`` join into (or scatter into) ``layout``'s blocks in whole
    4-byte words: what the C copies need."""
    return _aligned(layout.shard, region_bytes(layout, num_blocks), tuple(heads))


@functools.lru_cache(maxsize=64)
def _aligned(shard: HeadShard, sizes: tuple[int, ...], heads: tuple[HeadRange, ...]) -> bool:
    return not np.any(join_plan(shard, sizes, heads)[:, 1:] % 4)


def join_checked(dst: torch.Tensor, sources: Sequence[torch.Tensor], plan: np.ndarray) -> tuple[int, list[int]]:
    """Copy ``plan``'s rows (source index, byte offset in it, byte offset in ``dst``, bytes) from the
    contiguous host ``uint8`` ``sources`` (whole piece payloads) into ``dst`` in one C call that reads
    each source byte once: (the KVSUM64 of the words written at their places in ``dst``, each
    source's KVSUM64), all unsigned. ValueError for offsets, sizes or sources not in 4-byte words."""
    lib = loaded()
    if (len(plan) and np.any(plan[:, 1:] % 4)) or any(t.numel() % 4 for t in sources):
        raise ValueError("every copy's offsets and size, and every source's size, must be multiples of 4 bytes.")
    for t in (dst, *sources):
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype != torch.uint8:
            raise ValueError("join_checked copies between contiguous host uint8 tensors.")
    base = np.array([t.data_ptr() for t in sources], dtype=np.int64)
    copies = np.empty((len(plan), 7), dtype=np.int64)
    copies[:, 0] = base[plan[:, 0]] + plan[:, 1]
    copies[:, 1] = dst.data_ptr() + plan[:, 2]
    copies[:, 2] = plan[:, 3]
    copies[:, 3], copies[:, 4] = plan[:, 2] // 4, 0  # the joined chunk's sum: sums[0]
    copies[:, 5], copies[:, 6] = plan[:, 1] // 4, 1 + plan[:, 0]  # the source's: sums[1 + source]
    rest = []
    for i, t in enumerate(sources):
        starts, sizes = _gaps(plan, i, t.numel())
        units = np.zeros((starts.size, 7), dtype=np.int64)
        units[:, 0], units[:, 2], units[:, 3], units[:, 4], units[:, 6] = base[i] + starts, sizes, starts // 4, 1 + i, -1
        rest.append(units)
    units = np.ascontiguousarray(np.concatenate([copies, *rest]))
    sums = np.zeros(1 + len(sources), dtype=np.uint64)
    if lib.kvt_copy2(units.ctypes.data, len(units), sums.ctypes.data, len(sums), _threads(units)) != 0:
        raise MemoryError("kvtier cpu copy: out of memory for its thread table.")
    return int(sums[0]), [int(v) for v in sums[1:]]


@functools.lru_cache(maxsize=64)
def split_plan(parts: tuple[tuple[HeadShard, tuple[int, ...]], ...], held: HeadRange) -> np.ndarray:
    """How :func:`split_checked` cuts one piece holding heads ``held`` into ``parts`` (each a
    destination's shard and its regions' bytes): ``int64 [copies, 4]`` (destination index, byte
    offset in the piece, byte offset in that destination, bytes). ValueError unless the copies read
    every byte of the piece exactly once (the piece's payload is then their bytes), in 4-byte words.
    The same for every chunk of a transfer (kept: read-only)."""
    plans = [join_plan(shard, sizes, (held,)) for shard, sizes in parts]
    plan = np.concatenate(plans)  # each row's source: 0, the piece
    if np.any(plan[:, 1:] % 4):
        raise ValueError("every copy's offsets and size must be multiples of 4 bytes.")
    if _gaps(plan, 0, int(plan[:, 3].sum()))[0].size:
        raise ValueError("the parts do not read every byte of the piece exactly once.")
    plan[:, 0] = np.repeat(np.arange(len(plans), dtype=np.int64), [len(rows) for rows in plans])
    plan.setflags(write=False)
    return plan


def split_checked(dsts: Sequence[torch.Tensor], source: torch.Tensor, plan: np.ndarray) -> tuple[list[int], int]:
    """Copy ``plan``'s rows (:func:`split_plan`) from the contiguous host ``uint8`` ``source`` (one
    whole piece payload) into ``dsts`` in one C call that reads each source byte once: (the KVSUM64
    of the words written into each destination at their places in it, the source's KVSUM64), all
    unsigned."""
    lib = loaded()
    for t in (source, *dsts):
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype != torch.uint8:
            raise ValueError("split_checked copies between contiguous host uint8 tensors.")
    units = np.empty((len(plan), 7), dtype=np.int64)
    units[:, 0] = source.data_ptr() + plan[:, 1]
    units[:, 1] = np.array([dst.data_ptr() for dst in dsts], dtype=np.int64)[plan[:, 0]] + plan[:, 2]
    units[:, 2] = plan[:, 3]
    units[:, 3], units[:, 4] = plan[:, 2] // 4, plan[:, 0]  # each destination's sum: sums[j]
    units[:, 5], units[:, 6] = plan[:, 1] // 4, len(dsts)  # the source's: sums[-1]
    sums = np.zeros(len(dsts) + 1, dtype=np.uint64)
    if lib.kvt_copy2(units.ctypes.data, len(units), sums.ctypes.data, len(sums), _threads(units)) != 0:
        raise MemoryError("kvtier cpu copy: out of memory for its thread table.")
    return [int(v) for v in sums[:-1]], int(sums[-1])


def piece_units(layout: Layout, span: PieceSpan, slot: int) -> np.ndarray:
    """``kvt_copy`` units (``int64 [units, 5]``, scatter direction) that copy ``span``'s pieces'
    heads of ``layout``'s into its engine blocks and sum every byte of piece ``i`` at its place in
    that piece into sums slot ``slot + i``. Blocks of the chunk outside the span are only summed."""
    n, heads = span.num_blocks, tuple(h for h, _ in span.pieces)
    regions = layout.regions
    sizes = tuple(piece_layout(layout, held).payload_bytes(n) for held in heads)
    plan, region, block, inner, gaps = _scatter_plan(layout.shard, region_bytes(layout, n),
                                                     tuple(r.block_bytes for r in regions), heads, sizes)
    for (held, buffer), size in zip(span.pieces, sizes):
        if buffer.device.type != "cpu" or not buffer.is_contiguous() or buffer.numel() < HEADER_BYTES + size:
            raise ValueError(f"piece of KV heads {held[0]}-{held[1]}: not a whole contiguous host chunk of {n} blocks.")
    stride = np.array([r.block_stride for r in regions], dtype=np.int64)
    base = np.array([r.blocks.data_ptr() for r in regions], dtype=np.int64)
    ids = span.block_ids.reshape(-1).to("cpu", torch.int64).numpy()
    if ids.size and (ids.min() < 0 or ids.max() >= layout.num_blocks):
        raise ValueError(f"block ids outside 0..{layout.num_blocks - 1}.")
    write = (block >= span.first) & (block < span.first + ids.size)
    at = np.clip(block - span.first, 0, max(ids.size - 1, 0))
    address = np.array([buffer.data_ptr() + HEADER_BYTES for _, buffer in span.pieces], dtype=np.int64)
    copies = np.empty((len(plan), 5), dtype=np.int64)
    copies[:, 0] = np.where(write, base[region] + (ids[at] if ids.size else 0) * stride[region] + inner, 0)
    copies[:, 1] = address[plan[:, 0]] + plan[:, 1]
    copies[:, 2] = plan[:, 3]
    copies[:, 3] = plan[:, 1] // 4
    copies[:, 4] = ((slot + plan[:, 0]) << 1) | write
    summed = np.zeros((len(gaps), 5), dtype=np.int64)  # bytes no row copies: only summed
    summed[:, 1] = address[gaps[:, 0]] + gaps[:, 1]
    summed[:, 2] = gaps[:, 2]
    summed[:, 3] = gaps[:, 1] // 4
    summed[:, 4] = (slot + gaps[:, 0]) << 1
    return np.concatenate([copies, summed])


@functools.lru_cache(maxsize=64)
def _scatter_plan(shard: HeadShard, sizes_of_regions: tuple[int, ...], block_bytes: tuple[int, ...], heads: tuple[HeadRange, ...],
                  sizes: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """What every chunk's :func:`piece_units` shares (kept, read-only): the join plan, each row's
    region, chunk block and offset inside that block, and ``int64 [gaps, 3]`` (piece, start, size)
    of the pieces' bytes no row copies."""
    plan = join_plan(shard, sizes_of_regions, heads)
    if np.any(plan[:, 1:] % 4):
        raise ValueError("the pieces' heads are not whole 4-byte words of the engine's blocks.")
    starts = np.concatenate([[0], np.cumsum(sizes_of_regions)[:-1]]).astype(np.int64)
    region = np.searchsorted(starts, plan[:, 2], side="right") - 1  # each row lies inside one block of one region
    within = plan[:, 2] - starts[region]
    size = np.array(block_bytes, dtype=np.int64)[region]
    gaps = [np.stack([np.full(g.size, i), g, z], axis=1) for i in range(len(heads)) for g, z in [_gaps(plan, i, sizes[i])]]
    out = (plan, region, within // size, within % size, np.concatenate(gaps).astype(np.int64))
    for array in out:
        array.setflags(write=False)
    return out


def _gaps(plan: np.ndarray, i: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(Starts, sizes) of source ``i``'s bytes in ``[0, size)`` that ``plan`` copies nowhere."""
    rows = plan[plan[:, 0] == i]
    rows = rows[np.argsort(rows[:, 1], kind="stable")]
    starts = np.concatenate([[0], rows[:, 1] + rows[:, 3]])
    ends = np.concatenate([rows[:, 1], [size]])
    gap = ends > starts
    return starts[gap], (ends - starts)[gap]


def _threads(units: np.ndarray) -> int:
    return max(1, min(default_threads(), int(units[:, 2].sum()) // BYTES_PER_THREAD if len(units) else 1))
