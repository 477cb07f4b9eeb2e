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
import time
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
            # checksum pass is one short read of the device's own memory: every SM may take part.
            self._kw = {"max_ctas": torch.cuda.get_device_properties(layout.device).multi_processor_count}
        self._scratch: torch.Tensor | None = None

    def launch(self, chunks: list[tuple[torch.Tensor, int]]) -> torch.Tensor | list[int]:
        """The sums of ``chunks`` (``(block_ids, num_blocks)``: ``int64 [num_blocks]`` engine block
        ids on the layout's device): on a GPU an ``int64 [len(chunks)]`` device tensor, enqueued
        on the current stream and not waited for (signed, see
        :func:`~kvtier.ops.checksum.as_unsigned`); on a CPU the unsigned sums, computed now."""
        largest = max(n for _, n in chunks)
        if self._scratch is None or self._scratch.numel() < codec.chunk_bytes(self.layout, largest):
            self._scratch = torch.empty(codec.chunk_bytes(self.layout, max(largest, self.chunk_blocks)),
                                        dtype=torch.uint8, device=self.layout.device)
        spans = [ChunkSpan(self._scratch[: codec.chunk_bytes(self.layout, n)], n, 0, ids) for ids, n in chunks]
        if self._read_only is not None:
            from kvtier.ops.triton_ops import build_plan

            sums = torch.zeros(len(spans), dtype=torch.int64, device=self.layout.device)
            plan = build_plan(self.layout, spans, write=False)
            if plan.num_units:
                self._read_only(plan, gather=True, sums=sums, **self._kw)
            return sums
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
        self.check_s = 0.0  # seconds spent checking, since start

    def first_bad(self, chunks: list[tuple[torch.Tensor, int, int]]) -> int | None:
        """Index of the first of ``chunks`` whose blocks do not hold what the producer saved, or
        None. Each chunk is ``(block_ids, num_blocks, expected)``: ``int64 [num_blocks]`` engine
        block ids on the layout's device and the KVSUM64 (unsigned) they must have as payload.
        One pass over all of them; runs on the current stream and waits for it."""
        if not chunks:
            return None
        begin = time.perf_counter()
        got = self._sums.launch([(ids, n) for ids, n, _ in chunks])
        if isinstance(got, torch.Tensor):
            got = as_unsigned(got.cpu())  # waits for the pass
        self.check_s += time.perf_counter() - begin
        return next((i for i, (value, (_, _, want)) in enumerate(zip(got, chunks)) if value != want), None)

    def loaded(self, job: LoadJob, landed: list[tuple[int, int, int, Landed]], done: int, chunks: int,
               ids: Callable[[tuple[int, ...]], torch.Tensor]) -> tuple[int, int, int]:
        """Check ``job``'s chunks that landed, ``(chunk, blocks loaded before it, its blocks, what
        came)`` each, when ``done`` blocks in ``chunks`` chunks were taken as loaded: from the first
        bad one on nothing counts (one line says so). Returns the (blocks, chunks, bytes landed)
        that count. ``ids``: block ids as a device tensor."""
        begin = self.check_s
        flat = ids(tuple(i for _, b, n, _ in landed for i in job.block_ids[b : b + n]))  # one copy to the device
        at = [0, *itertools.accumulate(n for _, _, n, _ in landed)]
        bad = self.first_bad([(flat[at[k] : at[k + 1]], n, x.checksum) for k, (_, _, n, x) in enumerate(landed)])
        logger.debug("kvtier P/D: %d chunks landed, checked in %.1f ms", len(landed), (self.check_s - begin) * 1e3)
        if bad is not None:
            i, done, _, _ = landed[bad]
            chunks = i - job.remote.first_chunk
            logger.warning("kvtier P/D: chunk %d of transfer %s from %s arrived in the engine's blocks with another "
                           "KVSUM64 than the producer saved; recomputing from there.", i, job.remote.transfer_id,
                           job.remote.endpoints[0])
        return done, chunks, sum(x.nbytes for _, b, _, x in landed if b < done)
