"""Check chunks that a P/D transfer wrote straight into the engine's blocks (HBM to HBM).

The producer sends the KVSUM64 of the chunk's payload (the blocks read region-major), taken from
its own blocks by :class:`BlockSums` at the end of the step that computed them (or by its save's
copy). Here the same pass sums the blocks that landed: on a GPU the copy kernel reads them and
writes nothing, one launch over a batch of chunks (at HBM speed: 4 GiB in a few ms), no host
round trip of the bytes. A mismatch means the blocks are not what the producer computed (a torn
or late READ, a reused block, a bit flip).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from kvtier import codec
from kvtier.jobs import Landed, LoadJob
from kvtier.layout import Layout
from kvtier.ops import backend_names, checksums_in_kernel, pick_backend
from kvtier.ops.checksum import as_unsigned, payload_checksum
from kvtier.ops.span import ChunkSpan

logger = logging.getLogger(__name__)


class BlockSums:
    """KVSUM64s of chunks' engine blocks, read region-major as a chunk payload: what a save's copy
    computes. On a GPU the copy kernel reads the blocks and sums them without writing anything
    (a read-only plan): one launch on the current stream, no wait for it. On a CPU the ``cpu``
    backend copies each chunk into a scratch chunk and sums it. ``chunk_blocks``: blocks of a
    whole chunk (the scratch a plan names, one chunk, allocated on first use)."""

    def __init__(self, layout: Layout, chunk_blocks: int):
        self.layout = layout
        self.chunk_blocks = chunk_blocks
        kernels = ("cuda", "triton") if layout.device.type == "cuda" else ("cpu",)
        name = next((n for n in kernels if n in backend_names()), "torch")
        self.in_kernel = checksums_in_kernel(name)
        self._gather = pick_backend(layout, name)[0]
        self._read_only = None  # the GPU kernel's launch (the plan says which blocks it writes: none)
        self._kw = {}
        if name in ("cuda", "triton"):
            from kvtier.ops import cuda_ops, triton_ops

            self._read_only = cuda_ops.launch if name == "cuda" else triton_ops.launch
            # The copies run with a bounded grid, so a reload leaves the model's kernels room; a
            # checksum pass is one short read of the device's own memory: every SM may take part,
            # Triton's kernel twice over (4 GiB on an H200: 1.77 ms with a CTA a SM, 1.19 with two,
            # bench/checksum_ctas.py; the CUDA C++ kernel's one a SM reads it in 1.0 ms).
            sms = torch.cuda.get_device_properties(layout.device).multi_processor_count
            self._kw = {"max_ctas": sms * (2 if name == "triton" else 1)}
        self._scratch: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._tables = torch.cuda.Stream(layout.device) if self._read_only is not None else None  # plans built ahead

    @property
    def ahead(self) -> bool:
        """Whether :meth:`plan` builds anything (on a GPU)."""
        return self._read_only is not None

    def plan(self, chunks: list[tuple[int, ...]]) -> tuple[tuple[tuple[int, ...], ...], object]:
        """``(chunks, the GPU kernel's read-only plan for them)``: ``chunks`` the engine block ids of
        each. Its tables are copied to the device on a stream of their own and waited for, so any
        thread may build it ahead of :meth:`launch`."""
        from kvtier.ops.triton_ops import build_plan

        with torch.cuda.stream(self._tables):
            flat = torch.tensor([i for c in chunks for i in c], dtype=torch.int64, device=self.layout.device)
            at = [0, *itertools.accumulate(len(c) for c in chunks)]
            spans = self._spans([(flat[at[k] : at[k + 1]], len(c)) for k, c in enumerate(chunks)])
            plan = build_plan(self.layout, spans, write=False)
        self._tables.synchronize()
        return tuple(chunks), plan

    def _spans(self, chunks: list[tuple[torch.Tensor, int]]) -> list[ChunkSpan]:
        largest = max(n for _, n in chunks)
        with self._lock:  # two threads may build plans at once (one ahead of its chunks' READ)
            if self._scratch is None or self._scratch.numel() < codec.chunk_bytes(self.layout, largest):
                self._scratch = torch.empty(codec.chunk_bytes(self.layout, max(largest, self.chunk_blocks)),
                                            dtype=torch.uint8, device=self.layout.device)
            scratch = self._scratch
        return [ChunkSpan(scratch[: codec.chunk_bytes(self.layout, n)], n, 0, ids) for ids, n in chunks]

    def launch(self, chunks: list[tuple[torch.Tensor, int]], ahead: tuple[object, int] | None = None,
               ) -> torch.Tensor | list[int]:
        """The sums of ``chunks`` (``(block_ids, num_blocks)``: ``int64 [num_blocks]`` engine block
        ids on the layout's device): on a GPU an ``int64 [len(chunks)]`` device tensor, enqueued
        on the current stream and not waited for (signed, see
        :func:`~kvtier.ops.checksum.as_unsigned`); on a CPU the unsigned sums, computed now.
        ``ahead``: ``(plan, first)``, a :meth:`plan` built ahead whose chunks ``first …`` are these (GPU)."""
        if self._read_only is not None:
            from kvtier.ops.triton_ops import build_plan

            plan, first = ahead or (build_plan(self.layout, self._spans(chunks), write=False), 0)
            sums = torch.zeros(plan.num_spans, dtype=torch.int64, device=self.layout.device)
            plan = plan.spans_slice(first, first + len(chunks)) if ahead else plan  # its span indices stay global
            if plan.num_units:
                self._read_only(plan, gather=True, sums=sums, **self._kw)
            return sums[first : first + len(chunks)]
        spans = self._spans(chunks)
        if self.in_kernel:
            sums = torch.empty(len(spans), dtype=torch.int64)
            self._gather(self.layout, spans, checksums_out=sums)
            return as_unsigned(sums)
        got = []
        for span in spans:
            self._gather(self.layout, [span])
            got.append(payload_checksum(span.buffer[codec.HEADER_BYTES:]))
        return got


class LandedCheck:
    """Checks chunks that landed in the engine's blocks against the producer's KVSUM64s
    (:class:`BlockSums`; ``chunk_blocks``: blocks of a whole chunk)."""

    def __init__(self, layout: Layout, chunk_blocks: int):
        self._sums = BlockSums(layout, chunk_blocks)
        self._ahead: ThreadPoolExecutor | None = None  # builds a transfer's check while its chunks are on their way
        self.check_s = 0.0  # seconds spent checking, since start

    def prepare(self, targets: list[tuple[int, ...] | None]) -> Future | None:
        """Build the check of a transfer's chunks ahead, on a thread of its own, while they are on
        their way: ``targets`` are the engine blocks each chunk lands in (None: it does not land).
        :meth:`loaded` checks any run of them that landed with it (a pull's, all at once; a push's,
        a step's at a time). None where nothing is built (a CPU)."""
        chunks = [t for t in targets if t is not None]
        if not chunks or not self._sums.ahead:
            return None
        if self._ahead is None:
            self._ahead = ThreadPoolExecutor(1, thread_name_prefix="kvtier-check-ahead")
        return self._ahead.submit(self._sums.plan, chunks)

    def first_bad(self, chunks: list[tuple[torch.Tensor | None, int, int]],
                  ahead: tuple[object, int] | None = None) -> int | None:
        """Index of the first of ``chunks`` whose blocks do not hold what the producer saved, or
        None. Each chunk is ``(block_ids, num_blocks, expected)``: ``int64 [num_blocks]`` engine
        block ids on the layout's device (None with a plan built ahead for them: ``ahead``, see
        :meth:`BlockSums.launch`) and the KVSUM64 (unsigned) they must have as payload. One pass
        over all of them; runs on the current stream and waits for it."""
        if not chunks:
            return None
        begin = time.perf_counter()
        got = self._sums.launch([(ids, n) for ids, n, _ in chunks], ahead)
        if isinstance(got, torch.Tensor):
            got = as_unsigned(got.cpu())  # waits for the pass
        self.check_s += time.perf_counter() - begin
        return next((i for i, (value, (_, _, want)) in enumerate(zip(got, chunks)) if value != want), None)

    def loaded(self, job: LoadJob, landed: list[tuple[int, int, int, Landed]], done: int, chunks: int,
               ids: Callable[[tuple[int, ...]], torch.Tensor], ahead: Future | None = None) -> tuple[int, int, int]:
        """Check ``job``'s chunks that landed, ``(chunk, blocks loaded before it, its blocks, what
        came)`` each, when ``done`` blocks in ``chunks`` chunks were taken as loaded: from the first
        bad one on nothing counts (one line says so). Returns the (blocks, chunks, bytes landed)
        that count. ``ids``: block ids as a device tensor. ``ahead``: :meth:`prepare`'s."""
        begin = self.check_s
        blocks = tuple(tuple(job.block_ids[b : b + n]) for _, b, n, _ in landed)
        plan = _built(ahead, blocks)  # (the plan, where these chunks begin in it)
        if plan is None:
            flat = ids(tuple(i for c in blocks for i in c))  # one copy to the device
            at = [0, *itertools.accumulate(len(c) for c in blocks)]
            rows = [(flat[at[k] : at[k + 1]], n, x.checksum) for k, (_, _, n, x) in enumerate(landed)]
        else:
            rows = [(None, n, x.checksum) for _, _, n, x in landed]
        bad = self.first_bad(rows, plan)
        logger.debug("kvtier P/D: %d chunks landed, checked in %.1f ms (its plan built %s)", len(landed),
                     (self.check_s - begin) * 1e3, "ahead" if plan is not None else "then")
        if bad is not None:
            i, done, _, _ = landed[bad]
            chunks = i - job.remote.first_chunk
            logger.warning("kvtier P/D: chunk %d of transfer %s from %s arrived in the engine's blocks with another "
                           "KVSUM64 than the producer saved; fetching it and those after from the producer's CPU tier.", i, job.remote.transfer_id,
                           job.remote.endpoints[0])
        return done, chunks, sum(x.nbytes for _, b, _, x in landed if b < done)


def _built(ahead: Future | None, blocks: tuple[tuple[int, ...], ...]) -> tuple[object, int] | None:
    """``(the plan built ahead, the index of the first of blocks in it)`` if it covers the chunks
    ``blocks`` as a run (else None: a plan is built now)."""
    if ahead is None or not blocks:
        return None
    try:
        built, plan = ahead.result()
    except Exception as exc:  # built again now, on the load's own thread
        logger.debug("kvtier P/D: the check built ahead failed (%s)", exc)
        return None
    first = built.index(blocks[0]) if blocks[0] in built else -1
    return (plan, first) if first >= 0 and built[first : first + len(blocks)] == blocks else None
