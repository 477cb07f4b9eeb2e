"""DMA paths: the GPU's copy engines move the bytes over PCIe, so the model keeps its SMs.

Modes (``mode=``):

- ``staged``: a short device-side kernel packs the engine blocks into a device staging buffer
  laid out as the chunk (HBM to HBM, a few CTAs, ~10x faster than PCIe so it runs a small
  fraction of the time), then one contiguous ``cudaMemcpyAsync`` per chunk moves it (reverse
  order for loads). A ring of ``SLOTS`` staging slots pipelines kernel and DMA on two streams;
  :func:`gather_async` / :func:`scatter_async` return with the copies in flight (:class:`Copying`),
  so a caller can fetch or store other chunks meanwhile.
- ``batch``: one ``cudaMemcpyBatchAsync`` with one copy per block and region (needs the CUDA C++
  extension, :mod:`kvtier.ops.cuda_ops`).
- ``loop``: one ``cudaMemcpyAsync`` per block and region (the naive DMA baseline).

Checksums are the same KVSUM64 as the kernels': ``staged`` computes them in its device kernel;
``batch``/``loop`` run a read-only checksum pass (over the engine blocks: HBM, cheap; and, for a
partial span's verification, over the rest of its host chunk). Which backend moves a batch,
this one or another, is :func:`kvtier.ops.copy_path.choose_path`'s rule, from measured numbers.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvtier.codec.geometry import HEADER_BYTES, region_offsets
from kvtier.layout import Layout
from kvtier.ops import cuda_ops, triton_ops
from kvtier.ops.checksum import to_signed
from kvtier.ops.span import ChunkSpan
from kvtier.ops.triton_ops import build_plan

MODES = ("staged", "batch", "loop")
KERNELS = ("auto", "cuda", "triton")
DEFAULT_MODE = "staged"
# Staging, per device and direction (saves and loads each have their own, so 2 x this in all once
# both have run): SLOTS slots of DEFAULT_STAGE_BYTES / SLOTS. Every slot is one kernel launch, and beside
# long model kernels a launch waits ~1-2 of them for SMs (H200, 8192^3 GEMM loop: 8 x 32 MiB slots
# moved 21-25 GB/s, 4 x 128 MiB 41.8-43.7 GB/s at <= 1.5% GEMM slowdown), so slots are large; 4 of
# them keep the DMA engine fed while one slot is packed. Idle, both reach ~52.5 GB/s.
DEFAULT_STAGE_BYTES = 512 << 20
SLOTS = 4
STAGE_CTAS = {"cuda": 4, "triton": 16}  # pack kernel CTAs: the C++ kernel keeps 64 KiB per CTA in flight, Triton 16
_ALIGN = 256


def available(mode: str = DEFAULT_MODE) -> bool:
    """Whether ``mode`` can run here (``staged`` needs a kernel backend, the others the C++ extension)."""
    if not torch.cuda.is_available():
        return False
    if mode == "staged":
        return triton_ops.available() or cuda_ops.available()
    return cuda_ops.available()


def _launch(kernel: str, max_ctas: int | None):
    """``(launch, ctas)`` of the device kernel that packs and checksums: CUDA C++ by default (one
    warp per unit, so a few CTAs keep 64 KiB each in flight: fewer SMs taken from the model), else
    Triton (one unit per CTA: it needs more CTAs for the same rate)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} is unknown; choose one of {KERNELS}.")
    name = "cuda" if kernel == "cuda" or (kernel == "auto" and cuda_ops.available()) else "triton"
    return (cuda_ops.launch if name == "cuda" else triton_ops.launch), max_ctas or STAGE_CTAS[name]


class _Stager:
    """Staging memory and streams of one device and one direction (saves and loads each have their
    own, so D2H and H2D run on their own copy engines and a load never queues behind a save).
    ``copy`` (DMA) is non-default: the batch API refuses the legacy stream. ``pack`` runs the
    short, few-CTA pack/unpack and checksum kernels at the highest priority, so they go first
    when SMs free up; they still wait for SMs behind long model kernels (priority alone did not
    lift 8 x 32 MiB slots above ~21 GB/s), hence the large slots.

    The slots form a ring that outlives a call: a call may return with its copies in flight (see
    :class:`Copying`), and the next one takes the next slots, each waiting on the GPU for the
    last copy that used it. ``lock`` serializes enqueueing (never waiting) between threads."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy = torch.cuda.Stream(device)
        self.pack = torch.cuda.Stream(device, priority=-100)  # clamped to the highest priority
        self.tables = torch.cuda.Stream(device)  # plan tables to the device, ahead of the copies behind them
        self.lock = threading.Lock()
        self.buffer: torch.Tensor | None = None
        self.slot_bytes = 0
        self.busy: list[torch.cuda.Event | None] = []  # per slot: its last use, on either stream
        self.next = 0  # the ring's next slot
        self.in_flight: deque[tuple[torch.cuda.Event, object]] = deque()  # device temporaries of running calls

    def ring(self, slot_bytes: int, slots: int) -> torch.Tensor:
        """The staging buffer as ``slots`` slots of ``slot_bytes``; (re)made only once every copy
        of ours has ended."""
        if self.buffer is None or self.slot_bytes != slot_bytes or len(self.busy) != slots:
            self.copy.synchronize()
            self.pack.synchronize()
            self.in_flight.clear()
            self.buffer = None
            with torch.inference_mode(False):  # a normal tensor: later calls may run in or out of inference mode
                self.buffer = torch.empty(slot_bytes * slots, dtype=torch.uint8, device=self.device)
            self.slot_bytes, self.busy, self.next = slot_bytes, [None] * slots, 0
        return self.buffer

    def keep(self, done: torch.cuda.Event, temporaries: object) -> None:
        """Hold a call's device temporaries (plan tables, checksums) until ``done``: the caching
        allocator would otherwise hand their memory out while our streams still read it."""
        while self.in_flight and self.in_flight[0][0].query():
            self.in_flight.popleft()
        self.in_flight.append((done, temporaries))


_stagers: dict[tuple[torch.device, bool], _Stager] = {}


def _stager(device: torch.device, gather: bool) -> _Stager:
    if (device, gather) not in _stagers:
        _stagers[device, gather] = _Stager(device)
    return _stagers[device, gather]


@dataclass(slots=True)
class Copying:
    """A batch of spans on its way. ``done[i]``: CUDA event recorded once span ``i`` is complete
    (gather: its bytes, and its KVSUM64 in ``checksums_out``, are in place; scatter: its engine
    blocks are written). ``blocks_read``: after it the engine blocks a gather reads may be
    overwritten. :meth:`wait` blocks until every span is complete and returns ``ok`` per span
    (a scatter's checksum verdicts; a gather's are all True). The caller keeps the spans' chunk
    buffers and ``block_ids`` alive until then."""

    done: list[torch.cuda.Event]
    blocks_read: torch.cuda.Event | None
    sums: torch.Tensor | None = None
    expected: Sequence[int] | torch.Tensor | None = None
    _ok: list[bool] | None = None
    began: torch.cuda.Event | None = None  # staged scatter: timing events around the whole batch
    ended: torch.cuda.Event | None = None  # after the last span (and the sums' copy to ``host_sums``)
    host_sums: torch.Tensor | None = None  # staged scatter with checksums: the sums in pinned host memory

    def ready(self) -> bool:
        """Whether every span is complete (asks the events; never waits)."""
        if self.ended is not None:
            return self.ended.query()
        return all(event.query() for event in dict.fromkeys(self.done))

    def elapsed_ms(self) -> float | None:
        """GPU ms from the batch's first copy to its last (staged, once :meth:`ready`), else None."""
        return self.began.elapsed_time(self.ended) if self.began is not None and self.ended is not None else None

    def wait(self) -> list[bool]:
        if self._ok is None:
            for event in [self.ended] if self.ended is not None else dict.fromkeys(self.done):  # each distinct once
                event.synchronize()
            self._ok = [True] * len(self.done)
            if self.expected is not None:  # on the host: a kernel here would queue for SMs behind the model's
                want = self.expected.tolist() if isinstance(self.expected, torch.Tensor) else self.expected
                if len(want) != len(self.done):
                    raise ValueError(f"{len(want)} expected checksums for {len(self.done)} spans.")
                got = self.host_sums if self.host_sums is not None else self.sums.cpu()
                self._ok = [g == to_signed(int(w)) for g, w in zip(got.tolist(), want)]
        return self._ok


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


def _groups(layout: Layout, spans: Sequence[ChunkSpan], slot_bytes: int) -> tuple[list[tuple[int, int]], list[int], int]:
    """Consecutive span groups ``(i0, i1)`` that fit a slot, each span's offset in its slot, and
    the slot size needed (a chunk larger than ``slot_bytes`` gets a slot of its own size)."""
    groups, offsets, i0, at, need = [], [], 0, 0, 0
    per_block = layout.bytes_per_block  # a sum over all regions: once, not per span
    for i, span in enumerate(spans):
        size = -(-(HEADER_BYTES + span.num_blocks * per_block) // _ALIGN) * _ALIGN
        if i > i0 and at + size > slot_bytes:
            groups.append((i0, i))
            i0, at = i, 0
        offsets.append(at)
        at += size
        need = max(need, at)
    if spans:
        groups.append((i0, len(spans)))
    return groups, offsets, need


def _staged(layout, spans, sums, gather: bool, verify: bool, max_ctas, stage_bytes: int, slots: int, kernel: str,
            checksums_out: torch.Tensor | None) -> tuple[list[torch.cuda.Event], torch.cuda.Event]:
    """Enqueue the staged copy of ``spans``, from the pack stream (current; it has waited for the
    caller's). Returns (per span, its completion event; the event after which the engine blocks
    have been read). ``checksums_out`` gets each group's sums as soon as the group is packed."""
    st = _stager(layout.device, gather)
    pack, copy = st.pack, st.copy
    groups, offsets, need = _groups(layout, spans, max(_ALIGN, stage_bytes // slots))
    slot = max(need, -(-max(_ALIGN, stage_bytes // slots) // _ALIGN) * _ALIGN)
    per_block = layout.bytes_per_block
    done: list[torch.cuda.Event] = []
    with st.lock:
        buf = st.ring(slot, slots)
        first = st.next
        slot_of = {i: (first + g) % slots for g, (i0, i1) in enumerate(groups) for i in range(i0, i1)}
        where = [slot_of[i] * slot + offsets[i] for i in range(len(spans))]
        staged = [ChunkSpan(buf[w : w + HEADER_BYTES + s.num_blocks * per_block], s.num_blocks, s.first, s.block_ids)
                  for s, w in zip(spans, where)]
        plan = build_plan(layout, staged, complement=verify, tables_stream=st.tables)  # each group launches its rows
        launch, ctas = _launch(kernel, max_ctas)
        for g, (i0, i1) in enumerate(groups):
            k = (first + g) % slots
            if gather:  # pack, then DMA to the host chunks
                if st.busy[k] is not None:
                    pack.wait_event(st.busy[k])
                with torch.cuda.stream(pack):
                    launch(plan.spans_slice(i0, i1), gather=True, sums=sums, max_ctas=ctas)
                copy.wait_event(pack.record_event())
                with torch.cuda.stream(copy):
                    for i in range(i0, i1):
                        for a, b in _ranges(layout, spans[i], whole=False):
                            spans[i].buffer[a:b].copy_(buf[where[i] + a : where[i] + b], non_blocking=True)
                    if checksums_out is not None:
                        checksums_out[i0:i1].copy_(sums[i0:i1], non_blocking=True)
                st.busy[k] = copy.record_event()
            else:  # DMA the host chunks in, then unpack (and verify)
                if st.busy[k] is not None:
                    copy.wait_event(st.busy[k])
                with torch.cuda.stream(copy):
                    for i in range(i0, i1):
                        for a, b in _ranges(layout, spans[i], whole=verify):
                            buf[where[i] + a : where[i] + b].copy_(spans[i].buffer[a:b], non_blocking=True)
                pack.wait_event(copy.record_event())
                with torch.cuda.stream(pack):
                    launch(plan.spans_slice(i0, i1), gather=False, sums=sums, max_ctas=ctas)
                st.busy[k] = pack.record_event()
            done += [st.busy[k]] * (i1 - i0)
        st.next = (first + len(groups)) % slots
        blocks_read = pack.record_event()
        st.keep(done[-1], (plan, sums))
    return done, blocks_read


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


def _per_block(layout, spans, sums, gather: bool, verify: bool, batched: bool, max_ctas, kernel: str) -> None:
    per_block, pinned = layout.bytes_per_block, {}
    for i, s in enumerate(spans):
        triton_ops._check_buffer(layout, s, i, per_block, pinned)
    st = _stager(layout.device, gather)
    caller, pack, copy = torch.cuda.current_stream(layout.device), st.pack, st.copy
    eng, chk, sizes = _block_addresses(layout, spans)
    copy.wait_stream(caller)  # blocks written (or read) by earlier work on the caller's stream
    cuda_ops.memcpy_blocks(chk if gather else eng, eng if gather else chk, sizes, copy, batched=batched)
    if sums is not None:
        launch, ctas = _launch(kernel, max_ctas)
        plans = [build_plan(layout, spans, write=False)]  # the engine blocks (HBM)
        if verify:  # a partial span's other chunk blocks, straight from the host chunk
            plans.append(build_plan(layout, spans, span_rows=False, complement=True))
        pack.wait_stream(caller)  # the plans' tables
        if not gather:
            pack.wait_stream(copy)  # verify the bytes that landed in the engine blocks
        with torch.cuda.stream(pack):
            for plan, direction in zip(plans, (True, False)):
                if plan.num_units:
                    launch(plan, gather=direction, sums=sums, max_ctas=ctas)
        pack.synchronize()
    copy.synchronize()


def _run(layout, spans, *, gather, checksums_out=None, expected=None, mode=DEFAULT_MODE, max_ctas=None,
         stage_bytes=DEFAULT_STAGE_BYTES, slots=SLOTS, kernel="auto") -> Copying:
    if mode not in MODES:
        raise ValueError(f"DMA mode {mode!r} is unknown; choose one of {MODES}.")
    verify = expected is not None and not gather
    if not spans:
        return Copying([], None, None, expected if verify else None)

    def zeroed_sums() -> torch.Tensor | None:
        return torch.zeros(len(spans), dtype=torch.int64, device=layout.device) if (checksums_out is not None or verify) else None

    if mode == "staged":
        # Everything this call launches runs on its own high-priority streams: beside a model, a
        # helper kernel (zeroing the sums, joining the block ids) on the caller's stream would
        # wait for SMs behind the model's kernels, and the copies behind it.
        pack = _stager(layout.device, gather).pack
        pack.wait_stream(torch.cuda.current_stream(layout.device))
        with torch.cuda.stream(pack):
            timed = None if gather else pack.record_event(torch.cuda.Event(enable_timing=True))
            sums = zeroed_sums()
            done, blocks_read = _staged(layout, spans, sums, gather, verify, max_ctas, stage_bytes, slots, kernel,
                                        checksums_out if gather else None)
            if gather:
                return Copying(done, blocks_read, sums)
            host_sums = None  # a scatter's sums on the host, read once ``ended`` fired: no copy on the caller's stream
            if verify:
                host_sums = torch.empty(len(spans), dtype=torch.int64, pin_memory=True)
                host_sums.copy_(sums, non_blocking=True)
            ended = pack.record_event(torch.cuda.Event(enable_timing=True))  # the unpacks run on pack: the last one
        return Copying(done, blocks_read, sums, expected if verify else None, began=timed, ended=ended, host_sums=host_sums)
    sums = zeroed_sums()
    _per_block(layout, spans, sums, gather, verify, mode == "batch", max_ctas, kernel)
    if gather and checksums_out is not None:
        checksums_out.copy_(sums)
    finished = torch.cuda.current_stream(layout.device).record_event()
    return Copying([finished] * len(spans), finished, sums, expected if verify else None)


def gather_async(
    layout: Layout,
    spans: Sequence[ChunkSpan],
    checksums_out: torch.Tensor | None = None,
    *,
    mode: str = DEFAULT_MODE,
    max_ctas: int | None = None,
    stage_bytes: int = DEFAULT_STAGE_BYTES,
    slots: int = SLOTS,
    kernel: str = "auto",
) -> Copying:
    """Start copying engine blocks into the spans' chunk payloads through the copy engines; see
    :class:`Copying` for when each span is there. ``checksums_out``: ``int64 [len(spans)]``,
    written span by span as the copies land (pinned host memory: read it after ``done[i]``
    without touching the GPU). ``staged`` returns at once; ``batch`` / ``loop`` when done.

    ``max_ctas``: CTAs of the device-side kernel (staged pack, or checksum pass). ``stage_bytes``:
    device staging memory of ``staged``, split into ``slots`` ring slots (one kernel launch each;
    a chunk larger than a slot gets a larger slot). ``kernel``: which backend's kernel packs and
    checksums."""
    return _run(layout, spans, gather=True, checksums_out=checksums_out, mode=mode, max_ctas=max_ctas,
                stage_bytes=stage_bytes, slots=slots, kernel=kernel)


def scatter_async(
    layout: Layout,
    spans: Sequence[ChunkSpan],
    expected_checksums: Sequence[int] | torch.Tensor | None = None,
    *,
    mode: str = DEFAULT_MODE,
    max_ctas: int | None = None,
    stage_bytes: int = DEFAULT_STAGE_BYTES,
    slots: int = SLOTS,
    kernel: str = "auto",
) -> Copying:
    """Start copying the spans' chunk payloads into engine blocks; :meth:`Copying.wait` gives
    ``ok`` per span. ``expected_checksums``: whole-chunk KVSUM64 per span, as in
    :func:`kvtier.ops.triton_ops.scatter` (staged mode then stages a partial span's whole chunk).
    A span with ``ok == False`` has left garbage in its engine blocks: report them as load
    errors, never use. Other arguments as in :func:`gather_async`."""
    return _run(layout, spans, gather=False, expected=expected_checksums, mode=mode, max_ctas=max_ctas,
                stage_bytes=stage_bytes, slots=slots, kernel=kernel)


def gather(layout: Layout, spans: Sequence[ChunkSpan], checksums_out: torch.Tensor | None = None, **kw) -> None:
    """:func:`gather_async`, returning when the bytes (and checksums) are in place."""
    gather_async(layout, spans, checksums_out, **kw).wait()


def scatter(layout: Layout, spans: Sequence[ChunkSpan], expected_checksums=None, **kw) -> list[bool]:
    """:func:`scatter_async`, returning ``ok`` per span once the engine blocks are written."""
    return scatter_async(layout, spans, expected_checksums, **kw).wait()
