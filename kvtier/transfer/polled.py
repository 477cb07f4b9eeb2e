"""Loads from the CPU tier polled on the engine's thread: their copies run on the GPU, none in a thread.

On CUDA a load whose chunks all sit in the CPU tier needs no thread: the caller (the engine's
thread, in the step that plans the load) takes the chunks, already in pinned host memory, and
starts their copies on the copy engines (``scatter_async``, on the load stream, after the event
after which blocks a save reads are free). Each later :meth:`PolledLoads.poll` asks the copies'
CUDA event and finishes every load whose copies ended: its chunks' KVSUM64 verdicts read from
pinned host memory, its buffers released, its outcome queued for ``take_finished``. So several
loads are in flight at once, each reported in the first poll after its copies end, none behind
another's report or behind an interpreter switch. A load with a chunk on disk or in the shared
tier is not taken here (reading it takes milliseconds a chunk): the load thread runs it.

Threads: :meth:`PolledLoads.start` runs on the caller's thread; :meth:`poll` and :meth:`wait` on
any (the engine's; a bench's); the list of loads in flight is guarded by one lock, never held
while a copy is waited for.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.jobs import LoadJob
from kvtier.ops import ChunkSpan
from kvtier.storage import ChunkBuffer
from kvtier.timeline import mark
from kvtier.transfer.common import now_ms

logger = logging.getLogger(__name__)

POLL_S = 0.0002  # :meth:`PolledLoads.wait` asks the events this often, s


@dataclass(slots=True)
class _InFlight:
    """One load whose copies were started: what :meth:`PolledLoads.poll` needs to finish it."""

    job: LoadJob
    copying: object  # kvtier.ops.dma_ops.Copying: ready(), wait() -> ok per span, elapsed_ms()
    buffers: list[ChunkBuffer]  # released once the copies that read them ended
    spans: list[ChunkSpan]
    tiers: list[str]
    start: float  # ms (now_ms) when the load began
    future: Future


class PolledLoad(Future):
    """A polled load's future: :meth:`result` finishes whatever loads' copies ended (waiting for
    them), so a caller that waits on it needs no poll of its own."""

    def __init__(self, polled: PolledLoads):
        super().__init__()
        self._polled = polled

    def result(self, timeout: float | None = None):
        self._polled.wait_for(self, timeout)
        return super().result(timeout=0)


class PolledLoads:
    """The polled loads of one :class:`~kvtier.transfer.load.LoadSide` (``side``)."""

    def __init__(self, side: Any):
        self._side = side
        self._lock = threading.Lock()
        self._out: list[_InFlight] = []

    @torch.inference_mode()
    def start(self, job: LoadJob) -> Future | None:
        """Start ``job``'s copies now if every chunk it needs is in the CPU tier (intact headers);
        None when one is not, or the copies could not start (the chunks taken so far are given
        back: the load thread runs it)."""
        side, start = self._side, now_ms()
        buffers, sums, spans, tiers, done = [], [], [], [], 0
        for i, key in enumerate(job.keys):
            if done == len(job.block_ids):
                break
            fetched = side.fetch(key, cpu_only=True)
            if fetched is None:
                for buffer in buffers:
                    buffer.release()
                return None
            first, count = side.span(job, i, done)
            buffers.append(fetched[0])
            sums.append(fetched[1])
            tiers.append(fetched[0].tier.value)
            spans.append((fetched[0].data, first, count, done))
            done += count
        mark(job.req_id, "load began")
        stream = side.load_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None and (reuse_after := side.reuse_after()) is not None:
                stream.wait_event(reuse_after)
            ids = side.ids(job.block_ids, non_blocking=True)
            spans = [ChunkSpan(data, side.chunk_blocks, first, ids[at : at + count]) for data, first, count, at in spans]
            try:
                copying = side.scatter_async(side.layout, spans, sums if side.kernel_sums else None)
            except Exception:  # the load thread runs it instead, and reports what fails there
                logger.exception("kvtier: request %s's copies could not start here", job.req_id)
                for buffer in buffers:
                    buffer.release()
                return None
        future = PolledLoad(self)
        with self._lock:
            self._out.append(_InFlight(job, copying, buffers, spans, tiers, start, future))
        return future

    def poll(self) -> int:
        """Finish every load whose copies ended; returns how many."""
        with self._lock:
            ended = [load for load in self._out if load.copying.ready()]
            self._out = [load for load in self._out if load not in ended]
        for load in ended:
            self._finish(load)
        return len(ended)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a load's copies to end (the interpreter free meanwhile) and
        finish it; False when none was in flight."""
        if not self._out:
            return False
        deadline = time.monotonic() + timeout_s
        while not self.poll() and self._out and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return True

    def wait_for(self, future: Future, timeout_s: float | None) -> None:
        """Wait until ``future``'s load is finished (up to ``timeout_s``; None: for as long as it takes)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not future.done() and (deadline is None or time.monotonic() < deadline):
            if not self.poll():
                time.sleep(POLL_S)

    def drain(self) -> None:
        """Wait for every load in flight and finish it."""
        while self._out:
            if not self.poll():
                time.sleep(POLL_S)

    def _finish(self, load: _InFlight) -> None:
        side, job = self._side, load.job
        try:
            ok = load.copying.wait()  # ready: reads the verdicts on the host
            done = sum(span.block_ids.numel() for span in load.spans)
            if not all(ok):
                done = side.first_bad(job, load.spans, ok)
            gpu_ms = load.copying.elapsed_ms()
            if gpu_ms is not None and load.spans:
                side.cost.scattered(gpu_ms * side.chunk_blocks / max(1, done))
            failed = side.account(job, load.spans, load.tiers, done, load.start)
        except Exception:
            logger.exception("kvtier: load for request %s failed; its blocks will be recomputed", job.req_id)
            failed = set(job.block_ids)
        finally:
            for buffer in load.buffers:
                buffer.release()
        mark(job.req_id, "load ended")
        side.finished.put((job.req_id, failed))
        load.future.set_result(None)
