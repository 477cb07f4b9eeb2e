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
from kvtier.ops.span import ChunkSpan


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
    lib = loaded()
    if layout.device.type != "cpu":
        raise ValueError(f"the cpu ops backend copies host memory; this layout is on {layout.device}.")
    units = np.ascontiguousarray(build_units(layout, spans, complement=complement))
    sums = np.zeros(len(spans), dtype=np.uint64) if want_sums else None
    nbytes = int(units[:, 2].sum()) if len(units) else 0
    count = max(1, min(threads or default_threads(), nbytes // BYTES_PER_THREAD))
    rc = lib.kvt_copy(units.ctypes.data, len(units), int(gather), None if sums is None else sums.ctypes.data,
                      len(spans), count)
    if rc != 0:
        raise MemoryError("kvtier cpu copy: out of memory for its thread table.")
    return None if sums is None else [int(v) for v in sums]


def copy_summed(dst: torch.Tensor, sources: Sequence[torch.Tensor], plan: np.ndarray) -> int:
    """Copy ``plan``'s rows (source index, byte offset in it, byte offset in ``dst``, bytes) from the
    contiguous host ``uint8`` ``sources`` into ``dst`` in one C call, and return the KVSUM64
    (unsigned) of the words written at their places in ``dst``: ``dst``'s checksum when the rows
    write every byte of it. Offsets and sizes must be multiples of 4 bytes (ValueError otherwise)."""
    lib = loaded()
    if len(plan) and np.any(plan[:, 1:] % 4):
        raise ValueError("every copy's offsets and size must be multiples of 4 bytes.")
    for t in (dst, *sources):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("copy_summed copies between contiguous host tensors.")
    base = np.array([t.data_ptr() for t in sources], dtype=np.int64)
    units = np.empty((len(plan), 5), dtype=np.int64)
    units[:, 0] = base[plan[:, 0]] + plan[:, 1]  # read from (the "engine" side of a gather)
    units[:, 1] = dst.data_ptr() + plan[:, 2]  # written to, summed at its word index in ``dst``
    units[:, 2] = plan[:, 3]
    units[:, 3] = plan[:, 2] // 4
    units[:, 4] = 1  # span 0, written
    sums = np.zeros(1, dtype=np.uint64)
    count = max(1, min(default_threads(), int(plan[:, 3].sum()) // BYTES_PER_THREAD if len(plan) else 1))
    if lib.kvt_copy(units.ctypes.data, len(units), 1, sums.ctypes.data, 1, count) != 0:
        raise MemoryError("kvtier cpu copy: out of memory for its thread table.")
    return int(sums[0])


def join_checked(dst: torch.Tensor, sources: Sequence[torch.Tensor], plan: np.ndarray) -> tuple[int, list[int]]:
    """:func:`copy_summed` that also sums every byte of each source at its own place: (the KVSUM64
    of the words written at their places in ``dst``, each source's KVSUM64), all unsigned, from one
    C call that reads each source byte once. A join of pieces checks the pieces this way while it
    copies their heads, instead of in a pass of its own. ``sources`` whole payloads (their sizes
    multiples of 4 bytes, as ``plan``'s offsets and sizes; ValueError otherwise)."""
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
    rest = [_uncopied(i, plan, t.numel(), base[i]) for i, t in enumerate(sources)]
    units = np.ascontiguousarray(np.concatenate([copies, *rest]))
    sums = np.zeros(1 + len(sources), dtype=np.uint64)
    count = max(1, min(default_threads(), int(units[:, 2].sum()) // BYTES_PER_THREAD if len(units) else 1))
    if lib.kvt_copy2(units.ctypes.data, len(units), sums.ctypes.data, len(sums), count) != 0:
        raise MemoryError("kvtier cpu copy: out of memory for its thread table.")
    return int(sums[0]), [int(v) for v in sums[1:]]


def _uncopied(i: int, plan: np.ndarray, size: int, address: int) -> np.ndarray:
    """Units that only sum source ``i``'s bytes ``plan`` copies nowhere (``size`` bytes at
    ``address``), at their places in it: ``int64 [gaps, 7]``."""
    rows = plan[plan[:, 0] == i]
    rows = rows[np.argsort(rows[:, 1], kind="stable")]
    starts = np.concatenate([[0], rows[:, 1] + rows[:, 3]])
    ends = np.concatenate([rows[:, 1], [size]])
    gap = ends > starts
    starts, ends = starts[gap], ends[gap]
    units = np.empty((starts.size, 7), dtype=np.int64)
    units[:, 0], units[:, 1], units[:, 2] = address + starts, 0, ends - starts
    units[:, 3], units[:, 4], units[:, 5], units[:, 6] = starts // 4, 1 + i, 0, -1
    return units


def gather(layout: Layout, spans: Sequence[ChunkSpan], checksums_out: torch.Tensor | None = None) -> None:
    """Copy engine blocks into the spans' chunk payloads.

    ``checksums_out``: optional ``int64 [len(spans)]`` that receives each span's KVSUM64 over its
    own blocks at their chunk positions (the chunk's checksum when the span covers the chunk).
    """
    sums = run_copy(layout, spans, gather=True, want_sums=checksums_out is not None)
    if checksums_out is not None:
        checksums_out.copy_(torch.tensor([to_signed(v) for v in sums], dtype=torch.int64))


def scatter(layout: Layout, spans: Sequence[ChunkSpan],
            expected_checksums: Sequence[int] | torch.Tensor | None = None) -> list[bool]:
    """Copy the spans' chunk payloads into engine blocks, verifying while copying.

    ``expected_checksums``: per span, the KVSUM64 of its WHOLE chunk payload (unsigned ints or
    ``int64``); a partial span also reads the rest of its chunk. Returns ``ok`` per span; a span
    with ``ok == False`` has written garbage into its engine blocks, which the caller must report
    as failed (recomputed), never use.
    """
    if expected_checksums is None:
        run_copy(layout, spans, gather=False, want_sums=False)
        return [True] * len(spans)
    if isinstance(expected_checksums, torch.Tensor):
        expected = [to_unsigned(v) for v in expected_checksums.tolist()]
    else:
        expected = [to_unsigned(int(v)) for v in expected_checksums]
    if len(expected) != len(spans):
        raise ValueError(f"{len(expected)} expected checksums for {len(spans)} spans.")
    sums = run_copy(layout, spans, gather=False, want_sums=True, complement=True)
    return [a == b for a, b in zip(sums, expected)]
