"""The save side (background): copy engine blocks out into chunks, then seal and store them.

Threads:

* :meth:`SaveSide.save` runs on the caller's thread (the engine's): it copies the blocks out,
  on CUDA on the save stream (made here), which first waits for the engine's stream; with ``dma``
  it only starts the copies, in batches of about ``pipeline_bytes``, and returns. The engine's
  stream then waits until the copies have read the blocks, or with ``defer_reuse`` only a step
  given one of those blocks does (:class:`ReuseGuard`, also the engine thread's).
* One save thread (``kvtier-save``) seals and stores each chunk once it is out, at a lower OS
  priority, and only while no load is running (``loads_running``, from the load side): saves
  yield to loads, never the reverse. It waits for the oldest chunk's copy, then stores it with
  every later one landed meanwhile in one ``put``: each wait lets go of the interpreter, which
  beside an engine thread running Python can take a switch interval (5 ms) to come back.

The backlog is bounded in bytes: where it could not take another save of the same size, a save
waits for its step's forward (see :meth:`SaveSide._ids`); overflow drops the oldest pending
chunks, counted and said (once a minute), instead of waiting for the store; so does a save that
finds no room in the pool.

Buffers: :meth:`SaveSide.save` allocates each chunk's buffer from the store (never waiting for
room). The save thread hands it to ``store.put``, which takes it, or releases it if storing fails;
a dropped chunk's buffer is released once its copy has landed. A backend that computes KVSUM64
while copying puts each batch's checksums in a host tensor (pinned on CUDA) the save thread
reads. A save's block-id device tensor lives in the :class:`ReuseGuard` until its blocks are read.

Locks: only the save side's own condition (backlog, its bytes, keys being saved, counters), never
held during a copy or a store; the store's own locks guard its index updates only."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from kvtier import codec
from kvtier.codec import checksums
from kvtier.jobs import SaveJob
from kvtier.keys import storage_key
from kvtier.layout import Layout
from kvtier.ops import ChunkSpan
from kvtier.ops.checksum import to_unsigned
from kvtier.storage import ChunkBuffer, ChunkStore
from kvtier.transfer.common import Copies, HeldChanged, TransferStats, now_ms, on_device
from kvtier.transfer.reuse import ReuseGuard

logger = logging.getLogger(__name__)

SAVE_NICE = 10  # the save thread's extra niceness: under CPU contention the load thread runs first
_YIELD_S = 0.0005  # how often a save waiting for loads to finish looks again
_SAY_EVERY_S = 60.0  # saves given up for one reason: one log line at most this often
STORE_BATCH = 64  # landed chunks the save thread seals and stores at once, at most


@dataclass(slots=True)
class _SaveBatch:
    """The chunks one save() call queued: timed from their copy-out until the last is handled."""

    start_ms: float
    left: int


@dataclass(slots=True)
class _PendingSave:
    """One gathered chunk waiting for the save thread. ``ready``: CUDA event of its gather."""

    key: bytes
    buffer: ChunkBuffer
    num_blocks: int
    ready: torch.cuda.Event | None
    sums: torch.Tensor | None = None  # int64 [chunks of its batch], host memory: KVSUM64s the copy computed, if it does
    index: int = 0  # this chunk's entry in ``sums``
    batch: _SaveBatch | None = None


class SaveSide:
    """Runs save jobs for ``layout`` into ``store``.

    ``chunk_blocks``: engine blocks per chunk. ``copies``: the backend's copy functions (this side
    gathers). ``stats``: counters shared with the load side. ``batch_ms``: ms per save batch,
    appended here. ``on_held``: called with storage keys stored.
    ``on_lost``: called with storage keys whose save was given up (dropped, no room, the store
    failed), so whoever waits for them (a P/D consumer) need not. ``on_found``: called with storage
    keys a save found stored already (nothing changed there). ``checksum``: the chunk checksum
    computed after the copy when the backend does not compute KVSUM64 while copying
    (:mod:`kvtier.codec.checksums`; None: the codec's default).
    ``backlog_bytes``: most bytes of gathered chunks waiting to be stored (None: unbounded).
    ``reuse``: when the engine may reuse blocks read here. ``loads_running``: local loads running
    now; the save thread waits while there are any. ``pipeline_bytes``: with a backend that copies
    in the background, gathers start in batches of about this many bytes.
    """

    def __init__(self, layout: Layout, store: ChunkStore, chunk_blocks: int, copies: Copies, stats: TransferStats,
                 batch_ms: deque[float], on_held: HeldChanged, checksum: str | None, backlog_bytes: int | None,
                 reuse: ReuseGuard, loads_running: Callable[[], int], pipeline_bytes: int, on_lost: HeldChanged,
                 on_found: HeldChanged):
        self.layout = layout
        self.store = store
        self.chunk_blocks = chunk_blocks
        self.backlog_bytes = backlog_bytes
        self.stats = stats
        self.batch_ms = batch_ms
        self.reuse = reuse
        self._gather, self._gather_async, self._kernel_sums = copies.gather, copies.gather_async, copies.kernel_sums
        self._host_checksum = codec.DEFAULT_HOST_CHECKSUM if checksum is None else checksums.kind_of(checksum)
        self._on_held, self._on_lost, self._on_found = on_held, on_lost, on_found
        self._said: dict[str, float] = {}  # reason -> when saves given up for it were last logged
        self._loads_running = loads_running
        self._pipeline_bytes = pipeline_bytes
        self._save_stream = torch.cuda.Stream(layout.device) if layout.device.type == "cuda" else None
        # everything below is guarded by _cond
        self._cond = threading.Condition()
        self._backlog: deque[_PendingSave] = deque()
        self._backlog_bytes = 0  # pending chunks plus the one being stored
        self._saving: set[bytes] = set()
        self._closing = False
        self._save_thread = threading.Thread(target=self._save_loop, name="kvtier-save", daemon=True)
        self._save_thread.start()

    def skey(self, key: bytes) -> bytes:
        return storage_key(key, self.layout.fingerprint)

    def _ids(self, block_ids, nbytes: int, wait: bool) -> torch.Tensor:
        """``block_ids`` on the engine's device, copied on the engine's stream from pinned memory.

        Not waited for while the backlog could take another save of this one's ``nbytes``: waiting
        holds the engine thread until the step's forward is done (0.7 s of a 1.35 s prefill batch
        at TP=2). Past that the save thread is falling behind (it needs the CPU and interpreter the
        engine thread keeps busy): the engine thread waits for its forward, so the save thread
        catches up and the next save drops nothing. ``wait``: wait anyway (see :meth:`save`)."""
        host = torch.tensor(block_ids, dtype=torch.int64)
        if self.layout.device.type != "cuda":
            return host
        ids = host.pin_memory().to(self.layout.device, non_blocking=True)
        pending = self.pending_bytes()  # this save's chunks included
        full = self.backlog_bytes is not None and pending + nbytes > self.backlog_bytes
        if wait or full:
            start = now_ms()
            torch.cuda.current_stream(self.layout.device).synchronize()
            if full and not wait:  # kvtier held the engine: counted in ``stats``, and said at DEBUG
                self.stats.backlog_waits += 1
                self.stats.backlog_wait_ms += (waited := now_ms() - start)
                logger.debug("kvtier: save backlog %d of %s B: this save of %d B waited %.1f ms for its step's "
                             "forward", pending, self.backlog_bytes, nbytes, waited)
        return ids

    def save(self, jobs: list[SaveJob], wait_forward: bool = False, after: torch.cuda.Event | None = None) -> int:
        """Copy the jobs' new chunks out and queue them for storing; returns how many were queued.
        The engine may reuse the blocks once this returns (on CUDA its stream waits until the
        copies have read them; with ``dma`` they run on in the background, a batch of about
        ``pipeline_bytes`` at a time, and the save thread stores each chunk as it lands).
        Never waits for storage. ``wait_forward``: wait for the step's forward whatever the
        backlog, as a P/D producer pushing into a consumer's GPU does (posting a WRITE maps the
        consumer's memory, which waits for the work queued on this GPU: a 32k push's first WRITE
        took 754 ms behind a queued step, vLLM 0.26, two H200s). ``after``: the copies start after
        this CUDA event too (a P/D producer's checksum pass, :mod:`kvtier.pd.producer.sums`).
        Chunks already stored are not saved again, only handed to ``on_found`` (a P/D producer
        pins them; rank 0's index already has them). Called from one thread (the engine's)."""
        cb = self.chunk_blocks
        wanted: list[tuple[bytes, list[int]]] = []
        stored: list[bytes] = []
        with self._cond:
            saving = set(self._saving)
        for job in jobs:
            for i, key in enumerate(job.keys):
                skey = self.skey(key)
                if skey in saving:
                    self.stats.skipped_saves += 1
                elif self.store.contains(skey) is not None:
                    self.stats.skipped_saves += 1
                    stored.append(skey)
                else:
                    saving.add(skey)
                    wanted.append((skey, list(job.block_ids[i * cb : (i + 1) * cb])))
        if stored:
            self._on_found(stored)
        if not wanted:
            return 0
        wanted, total = self._make_room(wanted)
        if not wanted:
            return 0
        ids = self._ids([b for _, blocks in wanted for b in blocks], total, wait_forward)  # one host-to-device copy for all
        batch = _SaveBatch(start := now_ms(), 0)
        group: list[tuple[_PendingSave, ChunkSpan]] = []
        started: list[_PendingSave] = []
        unallocated = at = 0
        lost: list[bytes] = []
        for skey, blocks in wanted:
            nbytes = codec.chunk_bytes(self.layout, len(blocks))
            span_ids, at = ids[at : at + len(blocks)], at + len(blocks)
            buffer = self.store.allocate(nbytes, wait=False)
            if buffer is None:
                unallocated += nbytes
                lost.append(skey)
                continue
            group.append((_PendingSave(skey, buffer, len(blocks), None, batch=batch),
                          ChunkSpan(buffer.data, len(blocks), 0, span_ids)))
            if self._gather_async is not None and len(group) * nbytes >= self._pipeline_bytes:
                started += self._start_gather(group, after)
                group = []
        if group:
            started += self._start_gather(group, after)
        self.reuse.saved((b for _, blocks in wanted for b in blocks), ids)
        # Queued only once every copy has started: the save thread's Python would otherwise slow
        # (through the GIL) the starting of the copies it waits for.
        with self._cond:
            batch.left = len(started)
            self._backlog.extend(started)
            self._saving.update(item.key for item in started)
            self._backlog_bytes -= unallocated  # give back their reservation
            self.stats.dropped_saves += len(wanted) - len(started)
            self.stats.save_ms += now_ms() - start
            self._cond.notify_all()
        if lost:
            self._given_up(lost, "no room in the CPU tier: its chunks are held by readers")
        return len(started)

    def _start_gather(self, group: list[tuple[_PendingSave, ChunkSpan]],
                      after: torch.cuda.Event | None = None) -> list[_PendingSave]:
        """Start copying ``group``'s chunks out; returns its items, each knowing when its copy has
        landed (and where its KVSUM64 will be)."""
        spans = [span for _, span in group]
        sums = None
        if self._kernel_sums:  # host memory (pinned for the copy engines): the save thread reads it
            on_host = self._gather_async is not None or self.layout.device.type == "cpu"
            sums = torch.empty(len(spans), dtype=torch.int64, device="cpu" if on_host else self.layout.device,
                               pin_memory=on_host and self.layout.device.type == "cuda")
        ready = self._gather_for_save(spans, sums, after)
        if sums is not None and sums.device.type != "cpu":
            sums = sums.cpu()  # a kernel backend: its gather has finished
        for i, ((item, _), event) in enumerate(zip(group, ready)):
            item.ready, item.sums, item.index = event, sums, i
        return [item for item, _ in group]

    def _make_room(self, wanted: list[tuple[bytes, list[int]]]) -> tuple[list[tuple[bytes, list[int]]], int]:
        """Reserve backlog bytes for ``wanted``, dropping the oldest pending chunks to make room;
        returns the part of ``wanted`` that may be gathered (its leading chunks: a chunk is only
        reachable by lookups through the chunks before it) and the bytes reserved for it."""
        limit = self.backlog_bytes
        sizes = [codec.chunk_bytes(self.layout, len(ids)) for _, ids in wanted]
        dropped: list[_PendingSave] = []
        refused: list[bytes] = []
        with self._cond:
            if limit is not None:
                need = sum(sizes)
                while self._backlog and self._backlog_bytes + need > limit:
                    item = self._backlog.popleft()
                    dropped.append(item)
                    self._backlog_bytes -= item.buffer.data.numel()
                    self._saving.discard(item.key)
                    self._batch_item_done(item)
                # The chunks being stored right now cannot be dropped; what still won't fit is.
                room, total = 0, self._backlog_bytes
                while room < len(sizes) and total + sizes[room] <= limit:
                    total += sizes[room]
                    room += 1
                self.stats.dropped_saves += len(dropped) + len(wanted) - room
                refused = [key for key, _ in wanted[room:]]
                wanted, sizes = wanted[:room], sizes[:room]
            reserved = sum(sizes)
            self._backlog_bytes += reserved
        for item in dropped:
            if item.ready is not None:
                item.ready.synchronize()  # its copy may still be landing in the buffer
            item.buffer.release()
        if dropped or refused:
            self._given_up([item.key for item in dropped] + refused, f"more than save_backlog_bytes={limit} waiting")
        return wanted, reserved

    def _given_up(self, keys: list[bytes], why: str) -> None:
        """Saves of ``keys`` will not be stored (``why``): said at most once a minute per reason."""
        if time.monotonic() - self._said.get(why, -_SAY_EVERY_S) >= _SAY_EVERY_S:
            self._said[why] = time.monotonic()
            logger.warning("kvtier: %d chunk saves given up (%s); those chunks are recomputed when needed. "
                           "%d given up since start.", len(keys), why, self.stats.dropped_saves)
        self._on_lost(keys)

    def _gather_for_save(self, spans: list[ChunkSpan], sums: torch.Tensor | None,
                         after: torch.cuda.Event | None = None) -> list[torch.cuda.Event | None]:
        """Copy ``spans`` out of the engine blocks (their KVSUM64s into ``sums``, if given), after
        ``after`` if given; per span, the CUDA event after which its chunk is on the host (None:
        it is already)."""
        kw = {} if sums is None else {"checksums_out": sums}
        if self._save_stream is None:
            self._gather(self.layout, spans, **kw)
            return [None] * len(spans)
        engine = torch.cuda.current_stream(self.layout.device)
        self._save_stream.wait_stream(engine)  # the forward that wrote the blocks comes first
        if after is not None:
            self._save_stream.wait_event(after)
        with torch.cuda.stream(self._save_stream):
            if self._gather_async is not None:
                copying = self._gather_async(self.layout, spans, **kw)
                self.reuse.blocks_read(engine, copying.blocks_read)
                return copying.done
            self._gather(self.layout, spans, **kw)
        ready = torch.cuda.Event()
        ready.record(self._save_stream)
        self.reuse.blocks_read(engine, ready)
        return [ready] * len(spans)

    def _save_loop(self) -> None:
        on_device(self.layout.device)()
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SAVE_NICE)  # this thread only
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._backlog or self._closing)
                if not self._backlog:
                    return
                first = self._backlog.popleft()
            while self._loads_running() and not self._closing:
                time.sleep(_YIELD_S)  # a latency-critical load has the CPU and memory bandwidth
            items = self._landed_after(first)
            start = now_ms()
            stored = self._seal_and_put(items)
            if stored:  # reported before the backlog shrinks: a wait for the saves sees them held
                self._on_held([item.key for item in items if item.key in stored])
            if len(stored) < len(items):
                self._on_lost([item.key for item in items if item.key not in stored])
            with self._cond:
                for item in items:
                    self._backlog_bytes -= codec.chunk_bytes(self.layout, item.num_blocks)
                    self._saving.discard(item.key)
                    if item.key in stored:
                        self.stats.saved_chunks += 1
                        self.stats.saved_bytes += self.layout.payload_bytes(item.num_blocks)
                    self._batch_item_done(item)
                self.stats.save_ms += now_ms() - start
                self._cond.notify_all()

    def _landed_after(self, first: _PendingSave) -> list[_PendingSave]:
        """``first`` once landed (the one wait), then those landed after it: :data:`STORE_BATCH` in all."""
        with contextlib.suppress(Exception):  # a failed copy fails when sealed
            if first.ready is not None:
                first.ready.synchronize()
        taken = [first]
        with self._cond:
            while self._backlog and len(taken) < STORE_BATCH and (self._backlog[0].ready is None
                                                                  or self._backlog[0].ready.query()):
                taken.append(self._backlog.popleft())
        return taken

    def _batch_item_done(self, item: _PendingSave) -> None:
        if (batch := item.batch) is not None:
            batch.left -= 1  # under _cond
            if batch.left == 0:
                self.batch_ms.append(now_ms() - batch.start_ms)

    @torch.inference_mode()  # buffers may be inference tensors made on the engine's thread
    def _seal_and_put(self, items: list[_PendingSave]) -> set[bytes]:
        """Seal each landed chunk (its header) and store them in one ``put``; the keys stored."""
        sealed: list[_PendingSave] = []
        for item in items:
            try:
                if item.ready is not None:
                    item.ready.synchronize()  # landed already: returns at once
                kvsum = None if item.sums is None else to_unsigned(int(item.sums[item.index]))
                codec.write_header(item.buffer.data, self.layout, item.num_blocks, kvsum, self._host_checksum)
                sealed.append(item)
            except Exception:
                logger.exception("kvtier: saving chunk %s failed; it will be recomputed when needed", item.key.hex())
                item.buffer.release()
        try:
            self.store.put([item.key for item in sealed], [item.buffer for item in sealed])
            return {item.key for item in sealed}
        except Exception:
            logger.exception("kvtier: storing %d chunks failed; they will be recomputed when needed", len(sealed))
            for item in sealed:
                item.buffer.release()
            return set()

    def pending_bytes(self) -> int:
        """Bytes of chunks gathered and not stored yet."""
        with self._cond:
            return self._backlog_bytes

    def saving(self, key: bytes) -> bool:
        """A save of storage key ``key`` is queued or running. Safe from any thread."""
        with self._cond:
            return key in self._saving

    def wait_saved(self) -> None:
        """Wait until every queued save is stored (or failed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._backlog_bytes == 0)

    def close(self) -> None:
        """Store what is queued, then stop the save thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._save_thread.join()
