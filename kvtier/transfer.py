"""Load and save jobs run between engine blocks and the tiers, on two executors that share nothing.

Engine-agnostic: the vLLM adapter turns its metadata into :class:`LoadJob` / :class:`SaveJob`;
benches and GPU tests drive :class:`TierWorker` directly.

* **Load executor** (latency-critical): one thread (and on CUDA its own stream) that fetches,
  verifies and scatters a request's chunks, then reports it finished. With ``dma`` each batch's
  copies start as soon as its chunks are fetched, so fetching overlaps copying. Chunks a P/D producer
  serves (``LoadJob.remote``) go through the same load, on a few threads of their own (a
  transfer may wait for the producer's prefill; a reload must not wait behind it), scattered
  one by one as they arrive while the next ones are on the wire, then kept in the CPU tier.
* **Save executor** (background): ``save()`` copies the blocks out on the caller's thread (on
  CUDA on a save stream the engine's stream then waits for; with ``dma`` it only starts the
  copies, in batches, and returns), and one thread seals and stores each chunk once it is out,
  at a lower OS priority, and only while no load is running: saves yield to loads, never
  the reverse. Its backlog is bounded in bytes: overflow drops the oldest pending chunks,
  counted, instead of blocking the engine.

The only lock the save side takes is its own (backlog bookkeeping, never held during a copy);
the load side takes none of kvtier's (it only bumps a counter the save thread reads). Both reach
the store, whose locks guard index updates only.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from kvtier import codec
from kvtier.codec import checksums
from kvtier.jobs import LoadJob, SaveJob
from kvtier.keys import storage_key
from kvtier.layout import Layout
from kvtier.ops import ChunkSpan, checksums_in_kernel, copies_in_background, pick_backend, resolve_backend
from kvtier.ops.checksum import to_unsigned
from kvtier.storage import ChunkBuffer, ChunkStore, Tier

logger = logging.getLogger(__name__)

HeldChanged = Callable[[list[bytes]], None]  # storage keys this worker stored, re-confirmed or promoted
# (job, [(chain key, blocks)] of its producer's chunks) -> those chunks in order, in buffers the
# caller owns; raises kvtier.pd.PeerError (after yielding what arrived) when the producer fails.
FetchRemote = Callable[[LoadJob, list[tuple[bytes, int]]], Iterator[ChunkBuffer]]
REMOTE_THREADS = 4  # P/D transfers in flight at once
SAVE_NICE = 10  # the save thread's extra niceness: under CPU contention the load thread runs first
_YIELD_S = 0.0005  # how often a save waiting for loads to finish looks again
_EWMA = 0.2  # weight of the newest sample in the per-tier load cost
PIPELINE_BYTES = 256 << 20  # with a backend that copies in the background (dma), a save or load is
# started in batches of about this many bytes, so allocating, sealing and storing chunks (save) or
# fetching them (load) overlaps the copies of the batches before. H100, 4 GiB beside a bf16 GEMM loop:
# 128 MiB moved 37.5 GB/s at 3.2% GEMM slowdown, 256 MiB 45.5 GB/s at 3.4%, 512 MiB 45.1 at 4.0%
# (fewer, larger batches: less of kvtier's Python between the engine thread's launches)


@dataclass(slots=True)
class TransferStats:
    """Counters since start (tokens, KV payload bytes, milliseconds). Loads are counted on the load thread,
    saves under the save side's lock; readers may see a snapshot a step old."""

    loaded_chunks: int = 0
    loaded_bytes: int = 0
    load_ms: float = 0.0
    failed_chunks: int = 0
    cpu_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    remote_hit_tokens: int = 0  # from a P/D producer
    shared_hit_tokens: int = 0  # from the shared Redis/Valkey tier
    saved_chunks: int = 0
    saved_bytes: int = 0
    save_ms: float = 0.0
    skipped_saves: int = 0
    dropped_saves: int = 0


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


class TierWorker:
    """Runs load and save jobs for one worker's ``layout`` against ``store``.

    ``chunk_blocks``: engine blocks per chunk. ``backend``: ops backend name (``auto`` picks the
    fastest for the layout's device). ``save_backlog_bytes``: most bytes of gathered chunks
    waiting to be stored (None: unbounded). ``on_held``: called with storage keys whose holding
    this worker changed (stored, found already stored, promoted from disk), from any thread.
    ``fetch_remote``: how chunks of a P/D producer are fetched (None: this worker never loads any).
    ``checksum``: the chunk checksum computed after the copy when the backend does not compute
    KVSUM64 while copying (:mod:`kvtier.codec.checksums`; None: the codec's default).
    ``defer_reuse``: a save returns without making the engine's stream wait until its engine
    blocks have been read; the caller must then call :meth:`guard_reuse` with every step's newly
    allocated blocks before that step's kernels (without it, a freed block could be overwritten
    while a save still reads it). Else the engine's stream waits for every save's reads.
    ``load_inline``: run loads from the local tiers on the caller's thread inside
    :meth:`submit_load` (finished before it returns) instead of the load thread. For a worker
    that shares its interpreter with the engine's loop: there the load thread waits for the GIL
    behind the loop at every hand-over (up to one switch interval, 5 ms by default, each time),
    while the loop has nothing better to do than wait for the load anyway.
    """

    def __init__(self, layout: Layout, store: ChunkStore, chunk_blocks: int, backend: str = "auto",
                 save_backlog_bytes: int | None = None, on_held: HeldChanged | None = None,
                 fetch_remote: FetchRemote | None = None, checksum: str | None = None, load_inline: bool = False,
                 defer_reuse: bool = False):
        self.layout = layout
        self.store = store
        self.chunk_blocks = chunk_blocks
        self.chunk_bytes = codec.chunk_bytes(layout, chunk_blocks)
        self.save_backlog_bytes = save_backlog_bytes
        self.stats = TransferStats()
        # ms per load job and per save batch, appended by the executors, drained by take_batch_ms()
        self.batch_ms: dict[str, deque[float]] = {"load": deque(), "save": deque()}
        self.backend = resolve_backend(layout, backend)
        self._gather, self._scatter = pick_backend(layout, self.backend)
        self._gather_async, self._scatter_async = copies_in_background(self.backend) or (None, None)
        self._kernel_sums = checksums_in_kernel(self.backend)  # else a separate pass on the host
        self._host_checksum = codec.DEFAULT_HOST_CHECKSUM if checksum is None else checksums.kind_of(checksum)
        self._on_held = on_held or (lambda keys: None)
        cuda = layout.device.type == "cuda"
        self._load_stream = torch.cuda.Stream(layout.device) if cuda else None
        self._save_stream = torch.cuda.Stream(layout.device) if cuda else None
        # Saves whose engine blocks may still be unread: (event after which they are read, block
        # ids, the device tensor of those ids), oldest first. Engine thread only.
        self.defer_reuse = defer_reuse and cuda
        self._unread: deque[tuple[torch.cuda.Event, frozenset[int], torch.Tensor]] = deque()
        self._last_read: torch.cuda.Event | None = None
        self._reuse_after: torch.cuda.Event | None = None  # loads wait for it: their blocks may be being read
        # load side
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
        self._remote_pool = ThreadPoolExecutor(REMOTE_THREADS, thread_name_prefix="kvtier-remote")
        self._remote_barrier = threading.Barrier(REMOTE_THREADS + 1)
        self._fetch_remote = fetch_remote
        self.load_inline = load_inline
        self._cancelled: set[str] = set()  # requests whose P/D transfer must stop (aborted)
        self._finished: queue.SimpleQueue[tuple[str, set[int]]] = queue.SimpleQueue()
        self._fetch_ms: dict[str, float] = {}  # tier -> EWMA ms to fetch and verify one chunk
        self._scatter_ms = 0.0  # EWMA ms to scatter one whole chunk
        self._loads_running = 0  # written by the load thread only; the save thread yields while > 0
        # save side: everything below is guarded by _cond
        self._cond = threading.Condition()
        self._backlog: deque[_PendingSave] = deque()
        self._backlog_bytes = 0  # pending chunks plus the one being stored
        self._saving: set[bytes] = set()
        self._closing = False
        self._save_thread = threading.Thread(target=self._save_loop, name="kvtier-save", daemon=True)
        self._save_thread.start()

    def skey(self, key: bytes) -> bytes:
        return storage_key(key, self.layout.fingerprint)

    def _ids(self, block_ids) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64, device=self.layout.device)

    # ---- save ---------------------------------------------------------------------------------
    def save(self, jobs: list[SaveJob]) -> int:
        """Copy the jobs' new chunks out and queue them for storing; returns how many were queued.
        The engine may reuse the blocks once this returns (on CUDA its stream waits until the
        copies have read them; with ``dma`` they run on in the background, a batch of about
        :data:`PIPELINE_BYTES` at a time, and the save thread stores each chunk as it lands).
        Never waits for storage.

        Chunks already stored are not saved again (they are reported held again, so a chunk
        withdrawn because another rank lost it becomes visible once that rank saves it anew).
        Called from one thread (the engine's).
        """
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
            self._on_held(stored)
        if not wanted:
            return 0
        wanted = self._make_room(wanted)
        ids = self._ids([b for _, blocks in wanted for b in blocks])  # one host-to-device copy for all
        start = _now_ms()
        batch = _SaveBatch(start, 0)
        group: list[tuple[_PendingSave, ChunkSpan]] = []
        started: list[_PendingSave] = []
        unallocated = at = 0
        for skey, blocks in wanted:
            nbytes = codec.chunk_bytes(self.layout, len(blocks))
            span_ids, at = ids[at : at + len(blocks)], at + len(blocks)
            buffer = self.store.allocate(nbytes, wait=False)
            if buffer is None:
                unallocated += nbytes
                continue
            group.append((_PendingSave(skey, buffer, len(blocks), None, batch=batch),
                          ChunkSpan(buffer.data, len(blocks), 0, span_ids)))
            if self._gather_async is not None and len(group) * nbytes >= PIPELINE_BYTES:
                started += self._start_gather(group)
                group = []
        if group:
            started += self._start_gather(group)
        if self.defer_reuse and self._last_read is not None:
            # ``ids`` too stays alive until the blocks are read: the copies read it on their own
            # stream, and freed now its memory could go to the engine's next kernels first.
            self._unread.append((self._last_read, frozenset(b for _, blocks in wanted for b in blocks), ids))
            self._last_read = None  # this save's: a later save that starts no copy records nothing
        # Queued only once every copy has started: the save thread's Python would otherwise slow
        # (through the GIL) the starting of the copies it waits for.
        with self._cond:
            batch.left = len(started)
            self._backlog.extend(started)
            self._saving.update(item.key for item in started)
            self._backlog_bytes -= unallocated  # give back their reservation
            self.stats.dropped_saves += len(wanted) - len(started)
            self.stats.save_ms += _now_ms() - start
            self._cond.notify_all()
        return len(started)

    def _start_gather(self, group: list[tuple[_PendingSave, ChunkSpan]]) -> list[_PendingSave]:
        """Start copying ``group``'s chunks out; returns its items, each knowing when its copy has
        landed (and where its KVSUM64 will be)."""
        spans = [span for _, span in group]
        sums = None
        if self._kernel_sums:  # host memory (pinned for the copy engines): the save thread reads it
            on_host = self._gather_async is not None or self.layout.device.type == "cpu"
            sums = torch.empty(len(spans), dtype=torch.int64, device="cpu" if on_host else self.layout.device,
                               pin_memory=on_host and self.layout.device.type == "cuda")
        ready = self._gather_for_save(spans, sums)
        if sums is not None and sums.device.type != "cpu":
            sums = sums.cpu()  # a kernel backend: its gather has finished
        for i, ((item, _), event) in enumerate(zip(group, ready)):
            item.ready, item.sums, item.index = event, sums, i
        return [item for item, _ in group]

    def _make_room(self, wanted: list[tuple[bytes, list[int]]]) -> list[tuple[bytes, list[int]]]:
        """Reserve backlog bytes for ``wanted``, dropping the oldest pending chunks to make room;
        returns the part of ``wanted`` that may be gathered (its leading chunks: a chunk is only
        reachable by lookups through the chunks before it)."""
        limit = self.save_backlog_bytes
        sizes = [codec.chunk_bytes(self.layout, len(ids)) for _, ids in wanted]
        dropped: list[_PendingSave] = []
        with self._cond:
            if limit is not None:
                need = sum(sizes)
                while self._backlog and self._backlog_bytes + need > limit:
                    item = self._backlog.popleft()
                    dropped.append(item)
                    self._backlog_bytes -= item.buffer.data.numel()
                    self._saving.discard(item.key)
                    self._batch_item_done(item)
                # The chunk being stored right now cannot be dropped; what still won't fit is.
                room, total = 0, self._backlog_bytes
                while room < len(sizes) and total + sizes[room] <= limit:
                    total += sizes[room]
                    room += 1
                self.stats.dropped_saves += len(dropped) + len(wanted) - room
                wanted, sizes = wanted[:room], sizes[:room]
            self._backlog_bytes += sum(sizes)
        for item in dropped:
            if item.ready is not None:
                item.ready.synchronize()  # its copy may still be landing in the buffer
            item.buffer.release()
        return wanted

    def _gather_for_save(self, spans: list[ChunkSpan], sums: torch.Tensor | None) -> list[torch.cuda.Event | None]:
        """Copy ``spans`` out of the engine blocks (their KVSUM64s into ``sums``, if given); per
        span, the CUDA event after which its chunk is on the host (None: it is already)."""
        kw = {} if sums is None else {"checksums_out": sums}
        if self._save_stream is None:
            self._gather(self.layout, spans, **kw)
            return [None] * len(spans)
        engine = torch.cuda.current_stream(self.layout.device)
        self._save_stream.wait_stream(engine)  # the forward that wrote the blocks comes first
        with torch.cuda.stream(self._save_stream):
            if self._gather_async is not None:
                copying = self._gather_async(self.layout, spans, **kw)
                self._blocks_read(engine, copying.blocks_read)
                return copying.done
            self._gather(self.layout, spans, **kw)
        ready = torch.cuda.Event()
        ready.record(self._save_stream)
        self._blocks_read(engine, ready)
        return [ready] * len(spans)

    def _blocks_read(self, engine: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        """A later step may reuse the blocks a save reads only once ``event`` has passed: the
        engine's stream waits for it now, or (``defer_reuse``) :meth:`guard_reuse` makes it wait
        only for a step that was given one of those blocks."""
        if self.defer_reuse:
            self._last_read = event
        else:
            engine.wait_event(event)

    def guard_reuse(self, allocated) -> None:
        """Before a step's kernels (engine thread): if any of ``allocated`` (engine block ids the
        step was given) is a block an earlier save may still be reading, the engine's stream and
        later loads wait until it has been read. Cheap when nothing overlaps, which is the rule:
        blocks of running requests are never reallocated, only those of finished or preempted ones."""
        unread = self._unread
        while unread and unread[0][0].query():
            unread.popleft()
        if not unread or not allocated:
            return
        wanted = set(allocated)
        for event, blocks, _ in reversed(unread):  # the newest overlapping save; events are in stream order
            if not blocks.isdisjoint(wanted):
                torch.cuda.current_stream(self.layout.device).wait_event(event)
                self._reuse_after = event
                return

    def _save_loop(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SAVE_NICE)  # this thread only
        except (AttributeError, OSError):
            pass
        while True:
            with self._cond:
                while not self._backlog and not self._closing:
                    self._cond.wait()
                if not self._backlog:
                    return
                item = self._backlog.popleft()
            while self._loads_running and not self._closing:
                time.sleep(_YIELD_S)  # a latency-critical load has the CPU and memory bandwidth
            start = _now_ms()
            stored = self._seal_and_put(item)
            with self._cond:
                self._backlog_bytes -= codec.chunk_bytes(self.layout, item.num_blocks)
                self._saving.discard(item.key)
                self.stats.save_ms += _now_ms() - start
                if stored:
                    self.stats.saved_chunks += 1
                    self.stats.saved_bytes += self.layout.payload_bytes(item.num_blocks)
                self._batch_item_done(item)
                self._cond.notify_all()
            if stored:
                self._on_held([item.key])

    def _batch_item_done(self, item: _PendingSave) -> None:
        batch = item.batch
        if batch is not None:
            batch.left -= 1  # under _cond
            if batch.left == 0:
                self.batch_ms["save"].append(_now_ms() - batch.start_ms)

    @torch.inference_mode()  # buffers may be inference tensors made on the engine's thread
    def _seal_and_put(self, item: _PendingSave) -> bool:
        try:
            if item.ready is not None:
                item.ready.synchronize()
            kvsum = None if item.sums is None else to_unsigned(int(item.sums[item.index]))
            codec.write_header(item.buffer.data, self.layout, item.num_blocks, kvsum, self._host_checksum)
            self.store.put([item.key], [item.buffer])
            return True
        except Exception:
            logger.exception("kvtier: saving chunk %s failed; it will be recomputed when needed", item.key.hex())
            item.buffer.release()
            return False

    # ---- load ---------------------------------------------------------------------------------
    def submit_load(self, job: LoadJob) -> Future:
        """Load in the background (with ``load_inline``, a local-tier load runs now); the outcome
        is reported by :meth:`take_finished`."""
        if self.load_inline and job.remote is None:
            done: Future = Future()
            self._load_and_report(job)
            done.set_result(None)
            return done
        pool = self._load_pool if job.remote is None else self._remote_pool
        return pool.submit(self._load_and_report, job)

    @torch.inference_mode()
    def _load_and_report(self, job: LoadJob) -> None:
        local = job.remote is None  # a transfer may wait on its producer: saves need not yield to it
        self._loads_running += local
        try:
            if self._load_stream is None:
                failed = self.load(job)
            else:
                if self._reuse_after is not None:
                    self._load_stream.wait_event(self._reuse_after)
                with torch.cuda.stream(self._load_stream):
                    failed = self.load(job)
                self._load_stream.synchronize()  # the blocks are whole before the request resumes
        except Exception:
            logger.exception("kvtier: load for request %s failed; its blocks will be recomputed", job.req_id)
            failed = set(job.block_ids)
        finally:
            self._loads_running -= local
            self._cancelled.discard(job.req_id)
        self._finished.put((job.req_id, failed))

    def load(self, job: LoadJob) -> set[int]:
        """Load ``job`` now. Returns the engine block ids that were not loaded (empty on success).

        A chunk that is gone or fails verification ends the load there: it and every later block
        are reported failed, and a corrupt chunk is removed from the store so that no later
        lookup offers it again.
        """
        start = _now_ms()
        spans, buffers, sums, tiers, done = [], [], [], [], 0
        copies: list = []  # started scatters, in span order: each has wait() -> ok per span
        launched, begin = 0, None
        tokens = {"cpu": 0, "disk": 0, "shared": 0, "remote": 0}
        local = job.keys if job.remote is None else job.keys[: job.remote.first_chunk]
        if len(local) > 1:  # disk-resident chunks: read ahead all at once, not one by one
            self.store.will_need([self.skey(k) for k in local])
        ids = self._ids(job.block_ids)  # one host-to-device copy, before any chunk copy is in flight
        try:
            for i, key in enumerate(local):
                if done == len(job.block_ids):
                    break
                first, count = self._span(job, i, done)
                fetched = self._fetch(key)
                if fetched is None:
                    # The blocks from here on are recomputed and saved again, but a later chunk
                    # still indexed on disk would be skipped as stored: if its file went the way
                    # of this one (deleted, cut short), forget it now so the save replaces it.
                    self.store.drop_unreadable([self.skey(k) for k in local[i + 1:]])
                    break
                buffer, checksum = fetched
                buffers.append(buffer)
                sums.append(checksum)
                tiers.append(buffer.tier.value)
                spans.append(ChunkSpan(buffer.data, self.chunk_blocks, first, ids[done : done + count]))
                done += count
                if self._scatter_async is not None and (len(spans) - launched) * self.chunk_bytes >= PIPELINE_BYTES:
                    begin = _now_ms() if begin is None else begin
                    copies.append(self._start_scatter(spans[launched:], sums[launched:]))
                    launched = len(spans)
            if launched < len(spans):
                begin = _now_ms() if begin is None else begin
                copies.append(self._start_scatter(spans[launched:], sums[launched:]))
            ok = [flag for copy in copies for flag in copy.wait()]
            if spans:
                if not all(ok):
                    done = self._first_bad(job, spans, ok)
                per_chunk = (_now_ms() - begin) * self.chunk_blocks / max(1, done)
                old = self._scatter_ms
                self._scatter_ms = per_chunk if old == 0 else old + _EWMA * (per_chunk - old)
        finally:
            for copy in copies:  # no buffer goes back while a copy may still read it
                try:
                    copy.wait()
                except Exception:  # noqa: BLE001 - the load already failed; nothing reads these blocks
                    pass
            for buffer in buffers:
                buffer.release()
        loaded = blocks = 0  # chunks scattered intact: one failing the kernel's check is no hit
        for span, tier in zip(spans, tiers):
            blocks += span.block_ids.numel()
            if blocks > done:
                break
            tokens[tier] += span.block_ids.numel() * self.layout.block_size
            loaded += 1
        if job.remote is not None and len(local) == loaded and done < len(job.block_ids):
            local_done = done
            done, remote_chunks = self._load_remote(job, done)
            tokens["remote"] = (done - local_done) * self.layout.block_size
            loaded += remote_chunks
        stats = self.stats
        stats.loaded_chunks += loaded
        stats.loaded_bytes += done * self.layout.bytes_per_block
        stats.cpu_hit_tokens += tokens["cpu"]
        stats.disk_hit_tokens += tokens["disk"]
        stats.remote_hit_tokens += tokens["remote"]
        stats.shared_hit_tokens += tokens["shared"]
        elapsed = _now_ms() - start
        stats.load_ms += elapsed
        self.batch_ms["load"].append(elapsed)
        logger.debug("kvtier: request %s loaded %d of %d blocks (%s) in %.1f ms", job.req_id, done,
                     len(job.block_ids), ", ".join(f"{n} tokens from {t}" for t, n in tokens.items() if n), elapsed)
        if done < len(job.block_ids):
            stats.failed_chunks += 1
        return set(job.block_ids[done:])

    def _span(self, job: LoadJob, i: int, done: int) -> tuple[int, int]:
        """(first block within chunk ``i`` of ``job``, blocks loaded from it) when ``done`` are loaded."""
        first = job.first_block if i == 0 else 0
        return first, min(self._num_blocks(job, i) - first, len(job.block_ids) - done)

    def _num_blocks(self, job: LoadJob, i: int) -> int:
        return job.tail_blocks if job.tail_blocks and i == len(job.keys) - 1 else self.chunk_blocks

    def _load_remote(self, job: LoadJob, done: int) -> tuple[int, int]:
        """Fetch ``job``'s producer chunks and scatter each as it arrives (the next ones are on the
        wire meanwhile); full chunks then stay in this worker's CPU tier for the next turn.
        Returns (blocks loaded in all, chunks loaded from the producer). Verified on the host:
        a producer's chunk may carry either checksum kind."""
        remote = job.remote
        first = remote.first_chunk
        items = [(job.keys[i], self._num_blocks(job, i)) for i in range(first, len(job.keys))]
        held, count_chunks, chunks = [], 0, None
        try:
            chunks = self._fetch_remote(job, items)
            for i, buffer in enumerate(chunks, start=first):
                if done == len(job.block_ids):
                    buffer.release()
                    break
                num_blocks = self._num_blocks(job, i)
                try:
                    codec.verify_chunk(buffer.data, self.layout, num_blocks)
                except codec.ChunkError as exc:
                    buffer.release()
                    logger.warning("kvtier P/D: chunk %d of transfer %s from %s is unusable (%s); recomputing from there.",
                                   i, remote.transfer_id, remote.endpoints[0], exc)
                    break
                block, count = self._span(job, i, done)
                ids = self._ids(job.block_ids[done : done + count])
                self._scatter(self.layout, [ChunkSpan(buffer.data, num_blocks, block, ids)])
                if self._load_stream is not None:
                    self._load_stream.synchronize()  # the buffer is stored or freed next
                done += count
                count_chunks += 1
                if num_blocks == self.chunk_blocks:
                    skey = self.skey(job.keys[i])
                    self.store.put([skey], [buffer])  # takes the buffer; a key already stored is skipped
                    held.append(skey)
                else:
                    buffer.release()  # a prompt's partial tail: no later prompt can look it up
        except Exception as exc:  # kvtier.pd.PeerError, or the producer's socket failing under us
            logger.warning("kvtier P/D: transfer %s failed after %d of %d chunks (%s); recomputing the rest.",
                           remote.transfer_id, count_chunks, len(items), exc)
        finally:
            if chunks is not None:
                chunks.close()
        if held:
            self._on_held(held)
        return done, count_chunks

    def _start_scatter(self, spans: list[ChunkSpan], sums: list[int]):
        """Start scattering ``spans`` (checked against their chunks' KVSUM64s ``sums`` when the
        backend verifies while copying); returns what ``wait()`` gives ``ok`` per span."""
        expected = sums if self._kernel_sums else None
        if self._scatter_async is not None:
            return self._scatter_async(self.layout, spans, expected)
        ok = self._scatter(self.layout, spans, expected) if expected is not None else self._scatter(self.layout, spans)
        return _Copied(ok if expected is not None else [True] * len(spans))

    def _first_bad(self, job: LoadJob, spans: list[ChunkSpan], ok: list[bool]) -> int:
        """Blocks loaded intact before the first chunk the copy found corrupt, which is removed.
        From that chunk on every block counts as failed: vLLM recomputes from the first failed
        block, and the bad chunk's blocks hold garbage until then."""
        bad = ok.index(False)
        self._discard(job.keys[bad], "payload checksum mismatch in the copy kernel")
        return sum(span.block_ids.numel() for span in spans[:bad])

    def _discard(self, key: bytes, reason: str) -> None:
        """Remove a corrupt chunk so no later lookup offers it (the store's watcher reports it gone)."""
        self.store.remove(self.skey(key))
        logger.warning("kvtier: stored chunk %s is unusable (%s); removed it and recomputing.", key.hex(), reason)

    def _fetch(self, key: bytes) -> tuple[ChunkBuffer, int] | None:
        """The stored chunk for chain key ``key`` and its header checksum, or None (missing or
        corrupt). The payload is verified here unless the copy kernel verifies it while loading."""
        skey = self.skey(key)
        start = _now_ms()
        buffer = self.store.get(skey)
        if buffer is None:
            logger.warning("kvtier: chunk %s was evicted before it could be loaded; recomputing.", key.hex())
            return None
        try:
            header = codec.verify_chunk(buffer.data, self.layout, self.chunk_blocks, payload=not self._kernel_sums)
        except codec.ChunkError as exc:
            buffer.release()
            self._discard(key, str(exc))
            return None
        tier = buffer.tier.value
        ms = _now_ms() - start
        old = self._fetch_ms.get(tier)
        self._fetch_ms[tier] = ms if old is None else old + _EWMA * (ms - old)
        if buffer.tier in (Tier.DISK, Tier.SHARED):
            self._on_held([skey])  # promoted into the CPU tier
        return buffer, header.checksum

    def chunk_load_ms(self) -> dict[str, float]:
        """Measured ms to load one whole chunk from each tier (fetch, verify, scatter), as a
        moving average; a tier appears once a load has used it. Safe from any thread."""
        fetch = dict(self._fetch_ms)
        return {tier: ms + self._scatter_ms for tier, ms in fetch.items()}

    def take_finished(self) -> tuple[set[str], set[int]]:
        """Requests whose loads ended since the last call, and the block ids that failed."""
        req_ids: set[str] = set()
        failed: set[int] = set()
        while True:
            try:
                req_id, bad = self._finished.get_nowait()
            except queue.Empty:
                return req_ids, failed
            req_ids.add(req_id)
            failed |= bad

    def pending_save_bytes(self) -> int:
        """Bytes of chunks gathered and not stored yet."""
        with self._cond:
            return self._backlog_bytes

    def cancel(self, req_id: str) -> None:
        """Stop ``req_id``'s P/D transfer (the request was aborted); it still reports, failed."""
        self._cancelled.add(req_id)

    def cancelled(self, req_id: str) -> bool:
        return req_id in self._cancelled

    def saving(self, key: bytes) -> bool:
        """A save of storage key ``key`` is queued or running. Safe from any thread."""
        with self._cond:
            return key in self._saving

    def drain(self) -> None:
        """Wait for every submitted load and save."""
        self._load_pool.submit(lambda: None).result()
        for _ in range(REMOTE_THREADS):  # each remote thread takes one barrier: all earlier transfers ended
            self._remote_pool.submit(self._remote_barrier.wait)
        self._remote_barrier.wait()
        self.wait_saved()

    def wait_saved(self) -> None:
        """Wait until every queued save is stored (or failed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._backlog_bytes == 0)

    def close(self) -> None:
        """Finish pending work, then stop the executors. The store is closed by its owner."""
        self._load_pool.shutdown(wait=True)
        self._remote_pool.shutdown(wait=True)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._save_thread.join()


class _Copied:
    """A scatter that already ran: ``wait()`` gives its ``ok`` per span."""

    def __init__(self, ok: list[bool]):
        self.ok = ok

    def wait(self) -> list[bool]:
        return self.ok


def _now_ms() -> float:
    return time.perf_counter() * 1e3
