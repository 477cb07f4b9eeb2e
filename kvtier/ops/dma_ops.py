"""DMA paths: the GPU's copy engines move the bytes over PCIe, so the model keeps its SMs.

Modes (``mode=``):

- ``staged``: a short device-side kernel packs the engine blocks into a device staging buffer
  laid out as the chunk (HBM to HBM, a few CTAs, ~10x faster than PCIe so it runs a small
  fraction of the time), then one contiguous ``cudaMemcpyAsync`` per chunk moves it (reverse
  order for loads). Two staging halves pipeline kernel and DMA on two streams.
- ``batch``: one ``cudaMemcpyBatchAsync`` with one copy per block and region (needs the CUDA C++
  extension, :mod:`kvtier.ops.cuda_ops`).
- ``loop``: one ``cudaMemcpyAsync`` per block and region (the naive DMA baseline).

Checksums are the same KVSUM64 as the kernels': ``staged`` computes them in its device kernel;
``batch``/``loop`` run a read-only checksum pass (over the engine blocks: HBM, cheap; and, for a
partial span's verification, over the rest of its host chunk). :func:`choose_path` picks among
all backends from measured numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvtier.codec import HEADER_BYTES, chunk_bytes, region_offsets
from kvtier.layout import Layout
from kvtier.ops import ChunkSpan, cuda_ops, triton_ops
from kvtier.ops.triton_ops import build_plan, compare_sums

MODES = ("staged", "batch", "loop")
DEFAULT_MODE = "staged"
DEFAULT_STAGE_BYTES = 256 << 20  # two halves; each holds one group of chunks in flight
STAGE_CTAS = 16  # device-side pack/unpack kernel: HBM<->HBM needs few SMs to outrun PCIe
_ALIGN = 256


def available(mode: str = DEFAULT_MODE) -> bool:
    """Whether ``mode`` can run here (``staged`` needs a kernel backend, the others the C++ extension)."""
    if not torch.cuda.is_available():
        return False
    if mode == "staged":
        return triton_ops.available() or cuda_ops.available()
    return cuda_ops.available()


def _launch():
    return triton_ops.launch if triton_ops.available() else cuda_ops.launch


class _Stager:
    """Per-device staging halves and the copy stream (non-default: the batch API refuses the legacy one)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.halves: list[torch.Tensor | None] = [None, None]

    def ensure(self, nbytes: int) -> list[torch.Tensor]:
        # Called at the start of a call, when no copy of ours is in flight, so regrowing is safe.
        for i, buf in enumerate(self.halves):
            if buf is None or buf.numel() < nbytes:
                self.halves[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.halves  # type: ignore[return-value]


_stagers: dict[torch.device, _Stager] = {}


def _stager(device: torch.device) -> _Stager:
    if device not in _stagers:
        _stagers[device] = _Stager(device)
    return _stagers[device]


def _ranges(layout: Layout, span: ChunkSpan, whole: bool) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` of ``span.buffer`` the span moves: the whole payload when it
    covers its chunk (or ``whole``), else its blocks of each region (region-major layout)."""
    n, k = span.num_blocks, span.block_ids.numel()
    if whole or (span.first == 0 and k == n):
        return [(HEADER_BYTES, HEADER_BYTES + layout.payload_bytes(n))]
    return [
        (off + span.first * r.block_bytes, off + (span.first + k) * r.block_bytes)
        for r, off in zip(layout.regions, region_offsets(layout, n))
    ]


def _groups(layout: Layout, spans: Sequence[ChunkSpan], half_bytes: int) -> tuple[list[tuple[int, int, list[int]]], int]:
    """Consecutive span groups ``(i0, i1, staging offsets)`` that fit one half, and the half size needed."""
    groups, i0, offsets, at, need = [], 0, [], 0, 0
    for i, span in enumerate(spans):
        size = -(-chunk_bytes(layout, span.num_blocks) // _ALIGN) * _ALIGN
        if offsets and at + size > half_bytes:
            groups.append((i0, i, offsets))
            i0, offsets, at = i, [], 0
        offsets.append(at)
        at += size
        need = max(need, at)
    if offsets:
        groups.append((i0, len(spans), offsets))
    return groups, need


def _staged(layout: Layout, spans: Sequence[ChunkSpan], sums, gather: bool, verify: bool, max_ctas, stage_bytes: int) -> None:
    st = _stager(layout.device)
    main, copy = torch.cuda.current_stream(layout.device), st.stream
    groups, need = _groups(layout, spans, stage_bytes // 2)
    halves = st.ensure(need)
    launch = _launch()
    busy: list[torch.cuda.Event | None] = [None, None]  # last use of each half, on the other stream
    for g, (i0, i1, offsets) in enumerate(groups):
        buf = halves[g % 2]
        group = spans[i0:i1]
        staged = [
            ChunkSpan(buf[o : o + chunk_bytes(layout, s.num_blocks)], s.num_blocks, s.first, s.block_ids)
            for s, o in zip(group, offsets)
        ]
        part = None if sums is None else sums[i0:i1]
        if gather:  # pack on the main stream, then DMA to the host chunks on the copy stream
            if busy[g % 2] is not None:
                main.wait_event(busy[g % 2])
            launch(build_plan(layout, staged), gather=True, sums=part, max_ctas=max_ctas or STAGE_CTAS)
            packed = torch.cuda.Event()
            packed.record(main)
            copy.wait_event(packed)
            with torch.cuda.stream(copy):
                for s, o in zip(group, offsets):
                    for a, b in _ranges(layout, s, whole=False):
                        s.buffer[a:b].copy_(buf[o + a : o + b], non_blocking=True)
        else:  # DMA the host chunks in on the copy stream, then unpack (and verify) on the main one
            if busy[g % 2] is not None:
                copy.wait_event(busy[g % 2])
            with torch.cuda.stream(copy):
                for s, o in zip(group, offsets):
                    for a, b in _ranges(layout, s, whole=verify):
                        buf[o + a : o + b].copy_(s.buffer[a:b], non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(copy)
            main.wait_event(landed)
            launch(build_plan(layout, staged, complement=verify), gather=False, sums=part, max_ctas=max_ctas or STAGE_CTAS)
        busy[g % 2] = torch.cuda.Event()
        busy[g % 2].record(copy if gather else main)
    copy.synchronize()
    main.synchronize()


def _block_addresses(layout: Layout, spans: Sequence[ChunkSpan]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``int64 [R*T]`` engine addresses, chunk addresses and sizes of every block of every region."""
    ids = torch.cat([s.block_ids.reshape(-1) for s in spans]).to("cpu", torch.int64).numpy()
    j = np.concatenate([np.arange(s.first, s.first + s.block_ids.numel()) for s in spans]).astype(np.int64)
    n = np.concatenate([np.full(s.block_ids.numel(), s.num_blocks) for s in spans]).astype(np.int64)
    buf = np.concatenate([np.full(s.block_ids.numel(), s.buffer.data_ptr() + HEADER_BYTES) for s in spans]).astype(np.int64)
    regs = np.array([[r.blocks.data_ptr(), r.block_stride, r.block_bytes] for r in layout.regions], dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(regs[:, 2])[:-1]]).astype(np.int64)
    eng = regs[:, :1] + ids[None, :] * regs[:, 1:2]
    chk = buf[None, :] + n[None, :] * prefix[:, None] + j[None, :] * regs[:, 2:3]
    sizes = np.broadcast_to(regs[:, 2:3], eng.shape)
    return eng.ravel(), chk.ravel(), np.ascontiguousarray(sizes).ravel()


def _per_block(layout: Layout, spans: Sequence[ChunkSpan], sums, gather: bool, verify: bool, batched: bool) -> None:
    for i, s in enumerate(spans):
        triton_ops._check_buffer(layout, s, i)
    main, copy = torch.cuda.current_stream(layout.device), _stager(layout.device).stream
    eng, chk, sizes = _block_addresses(layout, spans)
    copy.wait_stream(main)  # blocks written (or read) by earlier work on the main stream
    cuda_ops.memcpy_blocks(chk if gather else eng, eng if gather else chk, sizes, copy, batched=batched)
    launch = _launch()
    if sums is not None:
        if not gather:
            main.wait_stream(copy)  # verify the bytes that actually landed in the engine blocks
        launch(build_plan(layout, spans, write=False), gather=True, sums=sums, max_ctas=STAGE_CTAS)
        if verify:  # a partial span's other chunk blocks, straight from the host chunk
            rest = build_plan(layout, spans, span_rows=False, complement=True)
            if rest.num_units:
                launch(rest, gather=False, sums=sums, max_ctas=STAGE_CTAS)
    copy.synchronize()
    main.synchronize()


def _run(layout, spans, *, gather, checksums_out=None, expected=None, mode=DEFAULT_MODE, max_ctas=None, stage_bytes=DEFAULT_STAGE_BYTES):
    if mode not in MODES:
        raise ValueError(f"DMA mode {mode!r} is unknown; choose one of {MODES}.")
    verify = expected is not None and not gather
    sums = torch.zeros(len(spans), dtype=torch.int64, device=layout.device) if (checksums_out is not None or verify) else None
    if spans:
        if mode == "staged":
            _staged(layout, spans, sums, gather, verify, max_ctas, stage_bytes)
        else:
            _per_block(layout, spans, sums, gather, verify, batched=mode == "batch")
    if gather and checksums_out is not None:
        checksums_out.copy_(sums)
    return compare_sums(sums, expected) if verify else [True] * len(spans)


def gather(
    layout: Layout,
    spans: Sequence[ChunkSpan],
    checksums_out: torch.Tensor | None = None,
    *,
    mode: str = DEFAULT_MODE,
    max_ctas: int | None = None,
    stage_bytes: int = DEFAULT_STAGE_BYTES,
) -> None:
    """Copy engine blocks into the spans' chunk payloads through the copy engines.

    ``checksums_out``: as in :func:`kvtier.ops.triton_ops.gather`. ``max_ctas``: CTAs of the
    device-side kernel (staged pack). ``stage_bytes``: device staging memory of ``staged`` (two
    halves; a chunk larger than a half gets a larger one). Returns when the bytes are in the chunks.
    """
    _run(layout, spans, gather=True, checksums_out=checksums_out, mode=mode, max_ctas=max_ctas, stage_bytes=stage_bytes)


def scatter(
    layout: Layout,
    spans: Sequence[ChunkSpan],
    expected_checksums: Sequence[int] | torch.Tensor | None = None,
    *,
    mode: str = DEFAULT_MODE,
    max_ctas: int | None = None,
    stage_bytes: int = DEFAULT_STAGE_BYTES,
) -> list[bool]:
    """Copy the spans' chunk payloads into engine blocks through the copy engines.

    ``expected_checksums``: whole-chunk KVSUM64 per span, as in :func:`kvtier.ops.triton_ops.scatter`
    (staged mode then stages a partial span's whole chunk). Returns ``ok`` per span; a span with
    ``ok == False`` has left garbage in its engine blocks: report them as load errors, never use.
    """
    return _run(layout, spans, gather=False, expected=expected_checksums, mode=mode, max_ctas=max_ctas, stage_bytes=stage_bytes)


@dataclass(frozen=True, slots=True)
class CopyPath:
    """Which backend moves a batch: ``backend`` in ``triton | cuda | dma | torch``; ``max_ctas``
    for the kernel backends (or the staged DMA's pack kernel); ``mode`` for ``dma``."""

    backend: str
    max_ctas: int | None = None
    mode: str | None = None


def choose_path(*, gpu_busy: bool, batch_bytes: int, available: Sequence[str]) -> CopyPath:
    """Pick the copy path for a batch of ``batch_bytes`` bytes.

    ``gpu_busy``: the model is running kernels now (a batch is in flight), so SMs are not free;
    ``available``: usable backend names (``kvtier.ops.backend_names()`` plus ``cuda``/``dma``).

    TODO(bench): rule and numbers from bench/gpu_copy.py.
    """
    if "dma" in available and (gpu_busy or "triton" not in available):
        return CopyPath("dma", STAGE_CTAS, DEFAULT_MODE)
    if "triton" in available:
        return CopyPath("triton", triton_ops.DEFAULT_MAX_CTAS)
    if "cuda" in available:
        return CopyPath("cuda", cuda_ops.DEFAULT_MAX_CTAS)
    return CopyPath("torch")
