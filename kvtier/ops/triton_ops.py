"""Triton gather/scatter between the engine's KV blocks and chunk buffers, one launch per batch.

Chunk buffers may sit in pinned host memory: the kernel reads and writes them in place through
UVA (zero copy, no staging), 16 bytes per access. A persistent grid of at most ``max_ctas`` CTAs
walks the batch's *units* (one region of one block each), so a copy occupies a bounded number of
SMs and leaves the rest of the GPU to the model. While copying, the kernel adds each unit's
KVSUM64 terms (:mod:`kvtier.ops.checksum`) into its span's checksum.

The descriptor tables (:class:`CopyPlan`, built once per call by :func:`build_plan`) are shared
with the CUDA C++ kernel (:mod:`kvtier.ops.cuda_ops`) and the DMA path (:mod:`kvtier.ops.dma_ops`).
Importing this module never compiles anything and works without CUDA or Triton.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from kvtier.codec.geometry import HEADER_BYTES
from kvtier.layout import Layout
from kvtier.ops.checksum import to_signed
from kvtier.ops.span import ChunkSpan

try:  # CI machines have no GPU backend; the kernel is only defined (never compiled) there
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure just means "no Triton backend"
    triton = None

VEC = 16  # bytes per vector access; every address, stride and block size must be a multiple
DEFAULT_MAX_CTAS = 16  # idle H200: 16 CTAs reach the plateau (49.4 GB/s save, 48.4 load); 8 load only 43.8
DEFAULT_TILE_BYTES = 16384  # bytes each CTA moves per loop step (32 B per thread at 16 warps)
DEFAULT_NUM_WARPS = 16


def available() -> bool:
    """True when Triton and a CUDA device are both usable here."""
    return triton is not None and torch.cuda.is_available()


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """Descriptor tables of one batch, on the layout's device. Addresses are in 16-byte units
    relative to ``anchor.data_ptr()`` (host and device share one UVA space, so any pinned host or
    device address can be written that way; Triton then knows every access is 16-byte aligned).

    ``regions``: ``int64 [R, 4]`` per region: first block's address, block stride, block size,
    sum of the sizes of the regions before it (the region's offset in a chunk of 1 block).
    ``blocks``: ``int64 [T, 5]`` per visited chunk block: span index, block index ``j`` in the
    chunk, write flag (0: read for the checksum only), chunk payload address, chunk block count.
    ``ids``: ``int64 [T]`` engine block id of each visited block (0 for read-only rows). Rows
    are grouped by span (its own blocks, then the rest of its chunk when ``complement``).
    A unit ``u < R*T`` is region ``u // T`` of block row ``u % T``.
    """

    anchor: torch.Tensor
    regions: torch.Tensor
    blocks: torch.Tensor
    ids: torch.Tensor
    num_spans: int
    span_starts: tuple[int, ...] = (0,)  # block rows of span s: span_starts[s] .. span_starts[s + 1]

    @property
    def num_units(self) -> int:
        return self.regions.shape[0] * self.blocks.shape[0]

    def spans_slice(self, s0: int, s1: int) -> CopyPlan:
        """The plan of spans ``s0 .. s1 - 1`` alone (views; span indices, so sums, stay global)."""
        r0, r1 = self.span_starts[s0], self.span_starts[s1]
        return CopyPlan(self.anchor, self.regions, self.blocks[r0:r1], self.ids[r0:r1], self.num_spans, (0, r1 - r0))


_anchors: dict[torch.device, torch.Tensor] = {}


def _anchor(device: torch.device) -> torch.Tensor:
    if device not in _anchors:
        _anchors[device] = torch.zeros(4, dtype=torch.int32, device=device)  # allocator: 512 B aligned
    return _anchors[device]


def _units16(addr: int, anchor: int, what: str) -> int:
    if addr % VEC:
        raise ValueError(f"{what} at address {addr:#x} is not {VEC}-byte aligned; the GPU copy kernels need it.")
    return (addr - anchor) // VEC


def _check_buffer(layout: Layout, span: ChunkSpan, index: int, bytes_per_block: int | None = None, pinned: dict | None = None) -> None:
    """Raise ValueError unless ``span`` is in range and its buffer is usable by the GPU kernels.

    ``bytes_per_block`` and ``pinned`` (a memo of storages already checked) save the per-span
    host work of large batches (128 spans x 64 regions).
    """
    buf, n, k = span.buffer, span.num_blocks, span.block_ids.numel()
    if not (0 <= span.first and span.first + k <= n):
        raise ValueError(f"span {index}: {k} blocks from {span.first} exceed a chunk of {n} blocks.")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"span {index}: chunk buffer must be a contiguous 1-D uint8 tensor.")
    need = HEADER_BYTES + n * (bytes_per_block if bytes_per_block is not None else layout.bytes_per_block)
    if buf.numel() < need:
        raise ValueError(f"span {index}: chunk buffer holds {buf.numel()} B, a {n}-block chunk needs {need} B.")
    if layout.device.type == "cuda" and buf.device != layout.device:
        key = buf.untyped_storage().data_ptr()
        ok = pinned.get(key) if pinned is not None else None
        if ok is None:
            ok = buf.device.type == "cpu" and buf.is_pinned()
            if pinned is not None:
                pinned[key] = ok
        if not ok:
            raise ValueError(f"span {index}: chunk buffer on {buf.device} is neither on {layout.device} nor pinned host memory.")


def build_plan(
    layout: Layout, spans: Sequence[ChunkSpan], *, write: bool = True, span_rows: bool = True, complement: bool = False,
    tables_stream: torch.cuda.Stream | None = None,
) -> CopyPlan:
    """Descriptor tables for copying ``spans`` (see :class:`CopyPlan`).

    ``write``: the spans' own blocks are copied (else only read, for a checksum). ``span_rows``:
    include the spans' own blocks at all. ``complement``: also read (never write) the chunk
    blocks outside each span, so a partial span's checksum covers its whole chunk.
    ``tables_stream``: where the tables' host-to-device copy runs (the current stream waits for
    it), so that it need not queue behind earlier copies on the current stream.
    """
    device = layout.device
    anchor = _anchor(device)
    a0 = anchor.data_ptr()
    regions = np.zeros((len(layout.regions), 4), dtype=np.int64)
    prefix = 0
    for r, region in enumerate(layout.regions):
        if region.block_bytes % VEC or region.block_stride % VEC:
            raise ValueError(f"region {region.name!r}: block size {region.block_bytes} B / stride {region.block_stride} B must be multiples of {VEC}.")
        base = _units16(region.blocks.data_ptr(), a0, f"region {region.name!r}")
        regions[r] = (base, region.block_stride // VEC, region.block_bytes // VEC, prefix)
        prefix += region.block_bytes // VEC
    # Per span: (first, k, n, payload); then all rows at once. A span's rows are contiguous (its
    # own blocks, then the rest of its chunk) so CopyPlan.spans_slice() can launch a run of spans.
    meta = np.zeros((len(spans), 4), dtype=np.int64)
    ids, pinned = [], {}
    zeros = torch.zeros(max((s.num_blocks for s in spans), default=0), dtype=torch.int64, device=device) if complement else None
    for s, span in enumerate(spans):
        _check_buffer(layout, span, s, prefix * VEC, pinned)
        n, k = span.num_blocks, span.block_ids.numel()
        meta[s] = (span.first, k, n, _units16(span.buffer.data_ptr() + HEADER_BYTES, a0, f"span {s} payload"))
        if span_rows and k:
            ids.append(span.block_ids.reshape(-1).to(device=device, dtype=torch.int64))
        if complement and k < n:
            ids.append(zeros[: n - k])
    first, k, n, payload = meta.T
    counts = (k if span_rows else 0) + (n - k if complement else 0)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    span = np.repeat(np.arange(len(spans), dtype=np.int64), counts)
    p = np.arange(starts[-1], dtype=np.int64) - starts[span]  # row index inside its span
    own = (p < k[span]) if span_rows else np.zeros(p.size, dtype=bool)
    q = p - (k[span] if span_rows else 0)  # index among the chunk's other blocks
    j = np.where(own, first[span] + p, np.where(q < first[span], q, q + k[span]))
    blocks = np.stack([span, j, own.astype(np.int64) * int(write), payload[span], n[span]], axis=1)
    if len(regions) * len(blocks) >= 2**31:
        raise ValueError(f"batch of {len(regions) * len(blocks)} units is too large for one launch; split it.")
    host = torch.from_numpy(np.concatenate([regions.ravel(), blocks.ravel()]))
    if device.type == "cuda":  # pinned + async: a pageable copy would make the host wait for the stream
        pinned = host.pin_memory()
        if tables_stream is None:
            tables = pinned.to(device, non_blocking=True)
        else:
            with torch.cuda.stream(tables_stream):
                tables = pinned.to(device, non_blocking=True)
            torch.cuda.current_stream(device).wait_stream(tables_stream)
    else:
        tables = host
    return CopyPlan(
        anchor=anchor,
        regions=tables[: regions.size].view(-1, 4),
        blocks=tables[regions.size :].view(-1, 5),
        ids=ids[0].contiguous() if len(ids) == 1 else torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64, device=device),
        num_spans=len(spans),
        span_starts=tuple(starts.tolist()),
    )


Launch = Callable[..., None]
"""``launch(plan, *, gather: bool, sums: Tensor | None, max_ctas: int | None)``: enqueue one copy."""


def run_copy(
    layout: Layout,
    spans: Sequence[ChunkSpan],
    launch: Launch,
    *,
    gather: bool,
    checksums_out: torch.Tensor | None = None,
    expected_checksums: Sequence[int] | torch.Tensor | None = None,
    max_ctas: int | None = None,
) -> list[bool]:
    """Build the plan, launch once on the current stream, wait, and check the checksums.

    Shared by the Triton and CUDA C++ backends. Returns one ``ok`` flag per span (all True when
    nothing was verified).
    """
    verify = expected_checksums is not None and not gather
    want_sums = checksums_out is not None or verify
    plan = build_plan(layout, spans, complement=verify)
    sums = torch.zeros(len(spans), dtype=torch.int64, device=layout.device) if want_sums else None
    if plan.num_units:
        launch(plan, gather=gather, sums=sums, max_ctas=max_ctas)
    if layout.device.type == "cuda":
        torch.cuda.current_stream(layout.device).synchronize()  # the caller reuses buffers next
    if checksums_out is not None and gather:
        checksums_out.copy_(sums)
    return compare_sums(sums, expected_checksums) if verify else [True] * len(spans)


def compare_sums(sums: torch.Tensor, expected: Sequence[int] | torch.Tensor) -> list[bool]:
    """``sums[i] == expected[i]`` per span; ``expected`` as unsigned ints or an ``int64`` tensor."""
    if isinstance(expected, torch.Tensor):
        want = expected.to(device=sums.device, dtype=torch.int64)
    else:
        want = torch.tensor([to_signed(int(v)) for v in expected], dtype=torch.int64, device=sums.device)
    if want.numel() != sums.numel():
        raise ValueError(f"{want.numel()} expected checksums for {sums.numel()} spans.")
    return (sums == want).tolist()


if triton is not None:

    @triton.jit
    def _unit(regions, blocks, ids, u, T, valid):
        """Raw descriptor values of unit ``u`` (loaded one unit ahead, so their latency hides)."""
        r = u // T
        b = u - r * T
        base = tl.load(regions + r * 4, mask=valid, other=0)
        stride = tl.load(regions + r * 4 + 1, mask=valid, other=0)
        vecs = tl.load(regions + r * 4 + 2, mask=valid, other=0)
        prefix = tl.load(regions + r * 4 + 3, mask=valid, other=0)
        span = tl.load(blocks + b * 5, mask=valid, other=0)
        j = tl.load(blocks + b * 5 + 1, mask=valid, other=0)
        write = tl.load(blocks + b * 5 + 2, mask=valid, other=0)
        payload = tl.load(blocks + b * 5 + 3, mask=valid, other=0)
        n = tl.load(blocks + b * 5 + 4, mask=valid, other=0)
        bid = tl.load(ids + b, mask=valid, other=0)
        return base, stride, vecs, prefix, span, j, write, payload, n, bid

    # One compile per (GATHER, CHECKSUM, TILE): sizes and table addresses (views of one plan) are
    # not specialized; only `anchor` is, since its 16-byte alignment is what enables 128-bit access.
    @triton.jit(do_not_specialize=["regions", "blocks", "ids", "sums", "R", "T"])
    def _copy_kernel(anchor, regions, blocks, ids, sums, R, T, GATHER: tl.constexpr, CHECKSUM: tl.constexpr, TILE: tl.constexpr):
        # anchor: int32 pointer; every address is anchor + 4 * (16-byte units), so Triton can
        # prove 16-byte alignment and emits 128-bit loads and stores.
        lane = tl.arange(0, TILE)
        total = R * T
        step = tl.num_programs(0)
        u = tl.program_id(0)
        base, stride, vecs, prefix, span, j, write, payload, n, bid = _unit(regions, blocks, ids, u, T, u < total)
        while u < total:
            nu = u + step
            nbase, nstride, nvecs, nprefix, nspan, nj, nwrite, npayload, nn, nbid = _unit(regions, blocks, ids, nu, T, nu < total)
            eng = (base + bid * stride) * 4  # int32 words from anchor
            pos = (n * prefix + j * vecs) * 4  # word index inside the chunk payload
            chk = payload * 4 + pos
            words = vecs * 4
            if GATHER:
                src = eng
                dst = chk
            else:
                src = chk
                dst = eng
            limit = words * write  # write is 0 or 1: read-only rows store nothing
            acc = tl.zeros([TILE], dtype=tl.uint64)
            for i in range(0, tl.cdiv(words, TILE)):
                off = i * TILE + lane
                m = off < words
                x = tl.load(anchor + src + off, mask=m, other=0)
                tl.store(anchor + dst + off, x, mask=off < limit)
                if CHECKSUM:  # KVSUM64 terms; masked lanes hold 0 and add nothing
                    h = (pos + off).to(tl.uint32) * 0x9E3779B1
                    h = h ^ (h >> 16)
                    h = h * 0x85EBCA6B
                    h = h ^ (h >> 13)
                    h = h | 1
                    acc += x.to(tl.uint32, bitcast=True).to(tl.uint64) * h.to(tl.uint64)
            if CHECKSUM:
                tl.atomic_add(sums + span, tl.sum(acc, axis=0).to(tl.int64, bitcast=True), sem="relaxed")
            u = nu
            base, stride, vecs, prefix, span, j, write, payload, n, bid = nbase, nstride, nvecs, nprefix, nspan, nj, nwrite, npayload, nn, nbid


def launch(
    plan: CopyPlan,
    *,
    gather: bool,
    sums: torch.Tensor | None = None,
    max_ctas: int | None = None,
    tile_bytes: int = DEFAULT_TILE_BYTES,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> None:
    """Enqueue the Triton copy of ``plan`` on the current stream (``sums``: ``int64 [S]``, added to)."""
    if triton is None:
        raise RuntimeError("Triton is not installed here; the triton ops backend is unavailable.")
    if tile_bytes < 512 or tile_bytes & (tile_bytes - 1):
        raise ValueError(f"tile_bytes must be a power of two >= 512, got {tile_bytes}.")
    grid = max(1, min(max_ctas or DEFAULT_MAX_CTAS, plan.num_units))
    _copy_kernel[(grid,)](
        plan.anchor, plan.regions, plan.blocks, plan.ids, plan.ids if sums is None else sums,
        plan.regions.shape[0], plan.blocks.shape[0],
        GATHER=gather, CHECKSUM=sums is not None, TILE=tile_bytes // 4, num_warps=num_warps,
    )


_warm: set[torch.device] = set()


def warm(device: torch.device) -> float:
    """Compile and load every variant of the copy kernel (gather or scatter, with or without the
    checksum) on ``device`` ahead of the first save or load, which would otherwise wait for
    Triton's compile (about half a second a variant on an H200; Triton keeps them on disk). Each is
    launched over an empty plan: one CTA that finds no unit, so nothing is read or written.
    Once per process and device; returns the seconds it took (0 when done before)."""
    if triton is None or device in _warm:
        return 0.0
    begin = time.perf_counter()
    with torch.cuda.device(device):
        empty = CopyPlan(_anchor(device), torch.zeros((0, 4), dtype=torch.int64, device=device),
                         torch.zeros((0, 5), dtype=torch.int64, device=device),
                         torch.zeros(0, dtype=torch.int64, device=device), 0)
        sums = torch.zeros(1, dtype=torch.int64, device=device)
        for gather in (True, False):
            for with_sums in (sums, None):
                launch(empty, gather=gather, sums=with_sums)
        torch.cuda.synchronize(device)
    _warm.add(device)
    return time.perf_counter() - begin


def gather(layout: Layout, spans: Sequence[ChunkSpan], checksums_out: torch.Tensor | None = None, *, max_ctas: int | None = None) -> None:
    """Copy engine blocks into the spans' chunk payloads (pinned host or device), one launch.

    ``checksums_out``: optional ``int64 [len(spans)]`` (any device) that receives each span's
    KVSUM64 over its own blocks at their chunk positions (the chunk's checksum when the span
    covers the whole chunk; partial spans of one chunk add up to it). Returns when the copy is done.
    """
    run_copy(layout, spans, launch, gather=True, checksums_out=checksums_out, max_ctas=max_ctas)


def scatter(
    layout: Layout, spans: Sequence[ChunkSpan], expected_checksums: Sequence[int] | torch.Tensor | None = None, *, max_ctas: int | None = None
) -> list[bool]:
    """Copy the spans' chunk payloads into engine blocks, one launch; verify while copying.

    ``expected_checksums``: per span, the KVSUM64 of its WHOLE chunk payload (as stored in the
    chunk header; unsigned ints or an ``int64`` tensor). A partial span then also reads (never
    writes) the rest of its chunk to check it. Returns ``ok`` per span. The blocks are written
    before the sum is known: a span with ``ok == False`` has left garbage in its engine blocks,
    which the caller must report as load errors (they are recomputed), never use.
    """
    return run_copy(layout, spans, launch, gather=False, expected_checksums=expected_checksums, max_ctas=max_ctas)
