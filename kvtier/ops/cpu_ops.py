"""Host gather/scatter in C (:mod:`kvtier.ops.cpu_library`): one pass that copies and computes KVSUM64.

The CPU twin of the CUDA kernels: same semantics and checksum as :mod:`kvtier.ops.triton_ops`
(``gather(..., checksums_out=)``, ``scatter(..., expected_checksums=) -> ok per span``), so a chunk
saved by either verifies on the other. A batch becomes one table of units (one per region and
chunk block) and one C call that splits it over a few threads; ctypes releases the GIL for the
whole call, so an engine loop in the same interpreter keeps running while KV moves.

The backend is there when its library builds here: without a C compiler or the source,
:func:`available` is False, :func:`build_error` says why, and ``auto`` falls back to the
``torch`` backend with a host checksum.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvtier.codec.geometry import HEADER_BYTES
from kvtier.layout import Layout
from kvtier.ops.checksum import to_signed, to_unsigned
from kvtier.ops.cpu_library import BYTES_PER_THREAD, default_threads, loaded
from kvtier.ops.cpu_library import available, build_error  # noqa: F401 - this backend is there when its library is
from kvtier.ops.cpu_pieces import piece_units
from kvtier.ops.span import ChunkSpan, PieceSpan


def build_units(layout: Layout, spans: Sequence[ChunkSpan], *, complement: bool = False) -> np.ndarray:
    """``int64 [units, 5]``: per (span block, region) engine address, chunk address, bytes, word
    index in the chunk payload, ``span << 1 | write``. ``complement`` adds read-only units for
    each span's other chunk blocks, so its checksum covers the whole chunk."""
    regions = layout.regions
    block_bytes = np.array([r.block_bytes for r in regions], dtype=np.int64)
    if np.any(block_bytes % 4):
        raise ValueError("every region's block size must be a multiple of 4 bytes.")
    stride = np.array([r.block_stride for r in regions], dtype=np.int64)
    base = np.array([r.blocks.data_ptr() for r in regions], dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(block_bytes)[:-1]]).astype(np.int64)  # bytes before region r in one block
    rows = []  # per span: (span, chunk block j, engine block id, write, payload address, n)
    for s, span in enumerate(spans):
        if span.buffer.device.type != "cpu" or not span.buffer.is_contiguous():
            raise ValueError(f"span {s}: chunk buffer must be a contiguous host tensor.")
        n, k = span.num_blocks, span.block_ids.numel()
        if span.buffer.numel() < HEADER_BYTES + n * int(block_bytes.sum()):
            raise ValueError(f"span {s}: chunk buffer of {span.buffer.numel()} B is too small for {n} blocks.")
        ids = span.block_ids.reshape(-1).to("cpu", torch.int64).numpy()
        if k and (ids.min() < 0 or ids.max() >= layout.num_blocks):
            raise ValueError(f"span {s}: block ids outside 0..{layout.num_blocks - 1}.")
        j = np.arange(span.first, span.first + k, dtype=np.int64)
        bid, write = ids, np.ones(k, dtype=np.int64)
        if complement and k < n:
            rest = np.setdiff1d(np.arange(n, dtype=np.int64), j)
            j = np.concatenate([j, rest])
            bid = np.concatenate([bid, np.zeros(rest.size, dtype=np.int64)])
            write = np.concatenate([write, np.zeros(rest.size, dtype=np.int64)])
        payload = span.buffer.data_ptr() + HEADER_BYTES
        rows.append(np.stack([np.full(j.size, s), j, bid, write, np.full(j.size, payload), np.full(j.size, n)], axis=1))
    if not rows:
        return np.zeros((0, 5), dtype=np.int64)
    s, j, bid, write, payload, n = np.concatenate(rows).T[:, :, None]  # [rows, 1] each, against [R] regions
    chunk_off = n * prefix + j * block_bytes  # byte offset inside the payload, region-major
    units = np.empty((s.shape[0], len(regions), 5), dtype=np.int64)
    units[..., 0] = base + bid * stride
    units[..., 1] = payload + chunk_off
    units[..., 2] = block_bytes
    units[..., 3] = chunk_off // 4
    units[..., 4] = (s << 1) | write
    return units.reshape(-1, 5)


def run_copy(layout: Layout, spans: Sequence[ChunkSpan], *, gather: bool, want_sums: bool, complement: bool = False,
             threads: int | None = None) -> list[int] | None:
    """Copy ``spans`` in one C call; the spans' KVSUM64s (unsigned) when ``want_sums``."""
    return _walk(layout, build_units(layout, spans, complement=complement), gather, len(spans) if want_sums else None,
                 threads)


def _walk(layout: Layout, units: np.ndarray, gather: bool, n_sums: int | None, threads: int | None = None
          ) -> list[int] | None:
    """Run ``kvt_copy`` over ``units``; its ``n_sums`` sums (unsigned), or None without sums."""
    lib = loaded()
    if layout.device.type != "cpu":
        raise ValueError(f"the cpu ops backend copies host memory; this layout is on {layout.device}.")
    units = np.ascontiguousarray(units)
    sums = np.zeros(n_sums, dtype=np.uint64) if n_sums is not None else None
    nbytes = int(units[:, 2].sum()) if len(units) else 0
    count = max(1, min(threads or default_threads(), nbytes // BYTES_PER_THREAD))
    rc = lib.kvt_copy(units.ctypes.data, len(units), int(gather), None if sums is None else sums.ctypes.data,
                      n_sums or 0, count)
    if rc != 0:
        raise MemoryError("kvtier cpu copy: out of memory for its thread table.")
    return None if sums is None else [int(v) for v in sums]


def gather(layout: Layout, spans: Sequence[ChunkSpan], checksums_out: torch.Tensor | None = None) -> None:
    """Copy engine blocks into the spans' chunk payloads.

    ``checksums_out``: optional ``int64 [len(spans)]`` that receives each span's KVSUM64 over its
    own blocks at their chunk positions (the chunk's checksum when the span covers the chunk).
    """
    sums = run_copy(layout, spans, gather=True, want_sums=checksums_out is not None)
    if checksums_out is not None:
        checksums_out.copy_(torch.tensor([to_signed(v) for v in sums], dtype=torch.int64))


def scatter(layout: Layout, spans: Sequence[ChunkSpan | PieceSpan],
            expected_checksums: Sequence[int | tuple[int, ...]] | torch.Tensor | None = None) -> list[bool]:
    """Copy the spans' chunk payloads into engine blocks, verifying while copying.

    ``expected_checksums``: per span, the KVSUM64 of its WHOLE chunk payload (unsigned ints or
    ``int64``); a partial span also reads the rest of its chunk. A :class:`PieceSpan`'s entry is
    the tuple of its pieces' KVSUM64s: each piece is checked whole as its heads are scattered
    (:func:`kvtier.ops.cpu_pieces.piece_units`). Returns ``ok`` per span; a span with ``ok ==
    False`` has written garbage into its engine blocks, which the caller must report as failed
    (recomputed), never use.
    """
    pieces = any(isinstance(span, PieceSpan) for span in spans)
    if expected_checksums is None:
        if pieces:
            raise ValueError("pieces are scattered only with their checksums.")
        run_copy(layout, spans, gather=False, want_sums=False)
        return [True] * len(spans)
    if isinstance(expected_checksums, torch.Tensor):
        expected_checksums = expected_checksums.tolist()
    expected = [tuple(to_unsigned(int(x)) for x in v) if isinstance(v, tuple) else (to_unsigned(int(v)),)
                for v in expected_checksums]
    if len(expected) != len(spans):
        raise ValueError(f"{len(expected)} expected checksums for {len(spans)} spans.")
    if not pieces:
        sums = run_copy(layout, spans, gather=False, want_sums=True, complement=True)
        return [a == b for a, b in zip(sums, (want for (want,) in expected))]
    units, slots = [], []  # slots: each span's [first, end) of the sums
    for span, want in zip(spans, expected):
        first = slots[-1][1] if slots else 0
        if isinstance(span, PieceSpan):
            if len(want) != len(span.pieces):
                raise ValueError(f"{len(want)} expected checksums for {len(span.pieces)} pieces.")
            units.append(piece_units(layout, span, first))
        else:
            chunk = build_units(layout, [span], complement=True)
            chunk[:, 4] = (first << 1) | (chunk[:, 4] & 1)
            units.append(chunk)
        slots.append((first, first + len(want)))
    sums = _walk(layout, np.concatenate(units), False, slots[-1][1])
    flat = [x for want in expected for x in want]
    return [sums[a:b] == flat[a:b] for a, b in slots]
