"""Load and save jobs run between engine blocks and the tiers, on two executors that share nothing.

Engine-agnostic: the vLLM adapter turns its metadata into :class:`~kvtier.jobs.LoadJob` /
:class:`~kvtier.jobs.SaveJob`; benches and GPU tests drive :class:`TierWorker` directly.

* :mod:`kvtier.transfer.load`: the load side (latency-critical): its load thread, its P/D fetch
  threads, its CUDA stream; fetch, verify, scatter, pipelined with ``dma``.
* :mod:`kvtier.transfer.save`: the save side (background): the copy-out on the engine's thread,
  the bounded backlog, the save thread that seals and stores, its CUDA stream; and
  :class:`~kvtier.transfer.reuse.ReuseGuard`, when the engine may reuse blocks a save reads.
* :mod:`kvtier.transfer.promote`: the promoter (lowest priority): reads disk chunks a plan left
  to recompute into the CPU tier once no load or save runs; built by the worker node.
* :mod:`kvtier.transfer.common`: what both use: :class:`TransferStats`, the copy functions, the
  per-tier load cost.

:class:`TierWorker` builds the two sides and is what callers use. The sides meet only where it
connects them, and neither imports the other:

* the save thread waits while local loads run (``loads_running``: :meth:`LoadSide.running`);
* a load on CUDA first waits for the event after which blocks a save reads are free
  (``reuse_after``: :attr:`ReuseGuard.reuse_after`, set by :meth:`TierWorker.guard_reuse`);
* both count into one :class:`TransferStats` and copy with one backend's functions.

The only lock the save side takes is its own (backlog bookkeeping, never held during a copy);
the load side takes none of kvtier's (it only bumps a counter the save thread reads). Both reach
the store, whose locks guard index updates only.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable
from concurrent.futures import Future

import torch

from kvtier import codec
from kvtier.jobs import LoadJob, SaveJob
from kvtier.keys import storage_key
from kvtier.layout import Layout
from kvtier.ops import resolve_backend, warm_kernels
from kvtier.storage import ChunkStore
from kvtier.transfer.common import Copies, FetchRemote, HeldChanged, TransferStats
from kvtier.transfer.load import REMOTE_THREADS, LoadSide
from kvtier.transfer.reuse import ReuseGuard
from kvtier.transfer.save import SAVE_NICE, SaveSide

__all__ = ["PIPELINE_BYTES", "REMOTE_THREADS", "SAVE_NICE", "FetchRemote", "HeldChanged", "LoadSide", "ReuseGuard",
           "SaveSide", "TierWorker", "TransferStats"]

logger = logging.getLogger(__name__)

PIPELINE_BYTES = 256 << 20  # with a backend that copies in the background (dma), a save or load is
# started in batches of about this many bytes, so allocating, sealing and storing chunks (save) or
# fetching them (load) overlaps the copies of the batches before. H100, 4 GiB beside a bf16 GEMM loop:
# 128 MiB moved 37.5 GB/s at 3.2% GEMM slowdown, 256 MiB 45.5 GB/s at 3.4%, 512 MiB 45.1 at 4.0%
# (fewer, larger batches: less of kvtier's Python between the engine thread's launches).
# Read when a TierWorker is built, and handed to both sides.


class TierWorker:
    """Runs load and save jobs for one worker's ``layout`` against ``store``.

    ``chunk_blocks``: engine blocks per chunk. ``backend``: ops backend name (``auto`` picks the
    fastest for the layout's device). ``save_backlog_bytes``: most bytes of gathered chunks
    waiting to be stored (None: unbounded). ``on_held``: called with storage keys whose holding
    this worker changed (stored, promoted from disk), from any thread; ``on_found``: with those a
    save found stored already, holding unchanged (None: ``on_held``).
    ``on_lost``: called with storage keys whose save was given up (see :class:`SaveSide`).
    ``fetch_remote``: how chunks of a P/D producer are fetched (None: this worker never loads any).
    ``checksum``: the chunk checksum computed after the copy when the backend does not compute
    KVSUM64 while copying (:mod:`kvtier.codec.checksums`; None: the codec's default).
    ``defer_reuse``: a save returns without making the engine's stream wait until its engine
    blocks have been read; the caller must then call :meth:`guard_reuse` with every step's newly
    allocated blocks before that step's kernels (without it, a freed block could be overwritten
    while a save still reads it). Else the engine's stream waits for every save's reads.
    ``load_inline``: run loads from the local tiers on the caller's thread inside
    :meth:`submit_load` (finished before it returns) instead of the load thread, in a step that
    computes nothing else. For a worker that shares its interpreter with the engine's loop: there
    the load thread waits for the GIL behind the loop at every hand-over (up to one switch
    interval, 5 ms by default, each time), while a loop with nothing else to compute can only wait
    for the load anyway. A step that computes other requests loads on the load thread: inline,
    their tokens waited for every load (a 16-session chat beyond HBM at TP=1, whose 16 loads a
    round held up the others' decoding, took 1.4 x as long as vLLM's connector).
    ``reuse``: another worker's :class:`ReuseGuard` to share (workers over KV cache groups of one
    block pool: a block one group's save reads may be given to another group); None: its own.
    ``loads_running``: how many loads run now, that this worker's saves yield to (workers over
    KV cache groups: every group's); None: its own loads.

    Built here and kept: ``loads`` (:class:`LoadSide`), ``saves`` (:class:`SaveSide`) and
    ``reuse`` (:class:`ReuseGuard`), the bookkeeping of save reads the two sides meet through.
    """

    def __init__(self, layout: Layout, store: ChunkStore, chunk_blocks: int, backend: str = "auto",
                 save_backlog_bytes: int | None = None, on_held: HeldChanged | None = None,
                 fetch_remote: FetchRemote | None = None, checksum: str | None = None, load_inline: bool = False,
                 defer_reuse: bool = False, on_lost: HeldChanged | None = None, reuse: ReuseGuard | None = None,
                 loads_running: Callable[[], int] | None = None, on_found: HeldChanged | None = None):
        self.layout = layout
        self.store = store
        self.chunk_blocks = chunk_blocks
        self.chunk_bytes = codec.chunk_bytes(layout, chunk_blocks)
        self.save_backlog_bytes = save_backlog_bytes
        self.stats = TransferStats()
        # ms per load job and per save batch, appended by the executors, drained by the caller
        self.batch_ms: dict[str, deque[float]] = {"load": deque(), "save": deque()}
        self.backend = resolve_backend(layout, backend)
        if took := warm_kernels(layout, self.backend):  # not in the first load: see warm_kernels
            logger.debug("kvtier: the Triton copy kernels were ready in %.2f s", took)
        copies = Copies.of(layout, self.backend)
        on_held = on_held or (lambda keys: None)
        self.defer_reuse = defer_reuse and layout.device.type == "cuda"
        self.load_inline = load_inline
        self.reuse = reuse = reuse or ReuseGuard(layout.device, self.defer_reuse)
        self.loads = LoadSide(layout, store, chunk_blocks, copies, self.stats, self.batch_ms["load"], on_held,
                              fetch_remote, load_inline, PIPELINE_BYTES, lambda: reuse.reuse_after)
        self.saves = SaveSide(layout, store, chunk_blocks, copies, self.stats, self.batch_ms["save"], on_held,
                              checksum, save_backlog_bytes, reuse, loads_running or self.loads.running, PIPELINE_BYTES,
                              on_lost or (lambda keys: None), on_found or on_held)
        self._loads_out: set[str] = set()  # requests whose load was submitted, not reported yet (engine thread)

    def skey(self, key: bytes) -> bytes:
        return storage_key(key, self.layout.fingerprint)

    # ---- save ---------------------------------------------------------------------------------
    def save(self, jobs: list[SaveJob], wait_forward: bool = False, after: torch.cuda.Event | None = None) -> int:
        """See :meth:`SaveSide.save`: copy the jobs' new chunks out and queue them for storing;
        returns how many were queued. Never waits for storage. Engine thread only."""
        return self.saves.save(jobs, wait_forward, after)

    def guard_reuse(self, allocated) -> None:
        """See :meth:`ReuseGuard.guard`: before a step's kernels (engine thread), make the step
        wait for saves still reading any of the engine blocks ``allocated`` it was given (counted
        in ``stats.reuse_waits``)."""
        if self.reuse.guard(allocated):
            self.stats.reuse_waits += 1

    def saving(self, key: bytes) -> bool:
        """A save of storage key ``key`` is queued or running. Safe from any thread."""
        return self.saves.saving(key)

    def pending_save_bytes(self) -> int:
        """Bytes of chunks gathered and not stored yet."""
        return self.saves.pending_bytes()

    def wait_saved(self) -> None:
        """Wait until every queued save is stored (or failed)."""
        self.saves.wait_saved()

    # ---- load ---------------------------------------------------------------------------------
    def submit_load(self, job: LoadJob, busy: bool = False) -> Future:
        """Load in the background (with ``load_inline``, a local-tier load runs now unless ``busy``:
        the step computes other requests too); the outcome is reported by :meth:`take_finished`."""
        self._loads_out.add(job.req_id)
        return self.loads.submit(job, busy)

    def wait_finished(self, timeout_s: float) -> bool:
        """With loads not reported yet, wait up to ``timeout_s`` for one to end, the interpreter
        left to the load threads meanwhile (vLLM's loop, stepping while requests wait for their
        loads, would hold it); what came stays for :meth:`take_finished`. Engine thread. False
        when no load was out (no wait)."""
        if not self._loads_out:
            return False
        if timeout_s > 0:
            self.loads.wait_finished(timeout_s)
        return True

    @property
    def load(self):
        """:meth:`LoadSide.load`: load a job now; returns the engine block ids not loaded.
        Assigning it replaces what the load threads and inline loads run."""
        return self.loads.load

    @load.setter
    def load(self, fn) -> None:
        self.loads.load = fn

    def take_finished(self) -> tuple[set[str], set[int]]:
        """Requests whose loads ended since the last call, and the block ids that failed."""
        req_ids, failed = self.loads.take_finished()
        self._loads_out -= req_ids
        return req_ids, failed

    def chunk_load_ms(self) -> dict[str, float]:
        """Measured ms to load one whole chunk from each tier (fetch, verify, scatter), as a
        moving average; a tier appears once a load has used it. Safe from any thread."""
        return self.loads.cost.chunk_load_ms()

    def probed_tiers(self) -> list[str]:
        """Tiers whose :meth:`chunk_load_ms` figure started from a read speed measured at start
        (:meth:`seed_read_speed`). Safe from any thread."""
        return self.loads.cost.probed()

    def seed_read_speed(self, tier: str, bytes_per_s: float) -> None:
        """Before any load: ``tier`` reads ``bytes_per_s`` (bytes/s), measured at start; its
        :meth:`chunk_load_ms` figure starts at one chunk's bytes at that speed (loads replace it)."""
        if bytes_per_s > 0:
            self.loads.cost.seed(tier, self.chunk_bytes / bytes_per_s * 1e3)

    def cancel(self, req_id: str) -> None:
        """Stop ``req_id``'s P/D transfer (the request was aborted); it still reports, failed."""
        self.loads.cancel(req_id)

    def cancelled(self, req_id: str) -> bool:
        return self.loads.cancelled(req_id)

    # ---- both ---------------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for every submitted load and save."""
        self.loads.drain()
        self.saves.wait_saved()

    def close(self) -> None:
        """Finish pending work, then stop the executors. The store is closed by its owner."""
        self.loads.close()
        self.saves.close()

    # The copy functions each side calls: assigning one replaces it there (benches time them).
    @property
    def _gather(self):
        return self.saves._gather

    @_gather.setter
    def _gather(self, fn) -> None:
        self.saves._gather = fn

    @property
    def _scatter(self):
        return self.loads._scatter

    @_scatter.setter
    def _scatter(self, fn) -> None:
        self.loads._scatter = fn

    @property
    def _gather_async(self):
        return self.saves._gather_async

    @property
    def _unread(self):
        """Saves whose engine blocks may still be unread (see :class:`ReuseGuard`)."""
        return self.reuse._unread
