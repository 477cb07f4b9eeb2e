"""The load side (latency-critical): fetch, verify and scatter a request's chunks into engine blocks.

Threads:

* On CUDA a load from the CPU tier alone runs in no thread: the caller starts its copies and
  :meth:`LoadSide.take_finished` polls their event (:mod:`kvtier.transfer.polled`).
* One load thread (``kvtier-load``) runs the other loads from the local tiers (disk, shared), one
  job at a time, and reports each request finished (``load_inline``: on the caller's thread, in a
  step computing nothing else).
* :data:`REMOTE_THREADS` threads (``kvtier-remote``) run loads with chunks a P/D producer serves
  (``LoadJob.remote``): a transfer may wait for the producer's prefill; a reload must not wait
  behind it. Their producer chunks are scattered one by one as they arrive while the next ones are
  on the wire (:mod:`kvtier.transfer.remote`), then kept in the CPU tier.

On CUDA every load runs on the load stream (made here, one for all those threads), which first waits for the
event after which blocks a save reads are free (``reuse_after``, from the save side; a P/D load waits for it
on the host: NIXL waits for no stream), and the load's copies have ended before it is reported finished. With
``dma`` each batch's copies start as soon as its chunks are fetched, so fetching overlaps copying.

Buffers: a local chunk's buffer comes from ``store.get`` and is released here once every copy that reads it
has finished. A producer's chunk comes in a buffer :data:`FetchRemote` hands over: it goes to ``store.put``
(which takes it) or is released here. A load's block-id tensor lives until its copies have been waited for.

Locks: the load side takes none of kvtier's. It bumps a counter the save thread reads
(:meth:`LoadSide.running`) and reports finished requests through a queue the engine thread drains. The store's
own locks guard its index updates only.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from kvtier import codec
from kvtier.jobs import LoadJob
from kvtier.keys import storage_key
from kvtier.layout import Layout
from kvtier.ops import ChunkSpan, cpu_ops, cpu_pieces
from kvtier.ops.span import PieceSpan
from kvtier.storage import ChunkBuffer, ChunkStore, Tier
from kvtier.timeline import mark
from kvtier.transfer import pieces
from kvtier.transfer.common import Copied, Copies, FetchRemote, HeldChanged, LoadCost, TransferStats, now_ms, on_device
from kvtier.transfer.landed import LandedCheck
from kvtier.transfer.polled import PolledLoads
from kvtier.transfer.remote import remote_pass

logger = logging.getLogger(__name__)

REMOTE_THREADS = 4  # P/D transfers in flight at once


class LoadSide:
    """Runs load jobs for ``layout`` from ``store``.

    ``chunk_blocks``: engine blocks per chunk. ``copies``: the backend's copy functions (this side
    scatters). ``stats``: counters shared with the save side. ``batch_ms``: ms per load job,
    appended here. ``on_held``: called with storage keys promoted into the CPU tier or kept from a
    producer. ``fetch_remote``: how chunks of a P/D producer are fetched (None: never any).
    ``load_inline``: see :meth:`submit`. ``pipeline_bytes``: with a backend that copies in the
    background, scatters start in batches of about this many bytes. ``reuse_after``: the CUDA
    event after which blocks a save reads are free (None: none pending); a load waits for it.
    """

    def __init__(self, layout: Layout, store: ChunkStore, chunk_blocks: int, copies: Copies, stats: TransferStats,
                 batch_ms: deque[float], on_held: HeldChanged, fetch_remote: FetchRemote | None, load_inline: bool,
                 pipeline_bytes: int, reuse_after: Callable[[], torch.cuda.Event | None]):
        self.layout = layout
        self.store = store
        self.chunk_blocks = chunk_blocks
        self.chunk_bytes = codec.chunk_bytes(layout, chunk_blocks)
        self.stats = stats
        self.batch_ms = batch_ms
        self.cost = LoadCost()
        self.load_inline = load_inline
        self._scatter, self.scatter_async, self.kernel_sums = copies.scatter, copies.scatter_async, copies.kernel_sums
        self._pipeline_bytes = pipeline_bytes
        self.on_held = on_held
        self.fetch_remote = fetch_remote
        self.reuse_after = reuse_after
        self.load_stream = torch.cuda.Stream(layout.device) if layout.device.type == "cuda" else None
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load", initializer=on_device(layout.device))
        self._last_local = self._load_pool.submit(lambda: None)  # the load thread's latest local load
        self._remote_pool = ThreadPoolExecutor(REMOTE_THREADS, thread_name_prefix="kvtier-remote",
                                               initializer=on_device(layout.device))
        self._remote_barrier = threading.Barrier(REMOTE_THREADS + 1)
        self._cancelled: set[str] = set()  # requests whose P/D transfer must stop (aborted)
        self.finished: queue.SimpleQueue[tuple[str, set[int]]] = queue.SimpleQueue()  # (request, failed ids)
        self._loads_running = 0  # written by whichever thread runs local loads; the save thread yields while > 0
        self.landed: LandedCheck | None = None  # set when producers may write chunks into the engine's blocks
        self._polled = PolledLoads(self) if self.scatter_async is not None else None  # CPU-tier loads, no thread
        # another TP size's pieces go straight into the engine's blocks where the host copy checks them as it goes
        self.scatters_pieces = (self._scatter is cpu_ops.scatter and self.kernel_sums and layout.shard is not None
                                and not layout.shard.replicated)

    def accept_landings(self) -> None:
        """P/D producers may write chunks straight into this engine's blocks from now on (its KV
        is registered with NIXL): they are checked here against their KVSUM64."""
        self.landed = LandedCheck(self.layout, self.chunk_blocks)

    def skey(self, key: bytes) -> bytes:
        return storage_key(key, self.layout.fingerprint)

    def ids(self, block_ids, non_blocking: bool = False) -> torch.Tensor:
        """``int64 [len(block_ids)]`` on the layout's device; ``non_blocking``: through pinned memory,
        on the current stream, without waiting for it."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if self.layout.device.type != "cuda":
            return ids
        return ids.pin_memory().to(self.layout.device, non_blocking=True) if non_blocking else ids.to(self.layout.device)

    def running(self) -> int:
        """Local loads running now (remote ones wait on their producer: saves need not yield to them)."""
        return self._loads_running

    def submit(self, job: LoadJob, busy: bool = False) -> Future:
        """Load in the background, reported by :meth:`take_finished`. On CUDA a load from the CPU tier
        alone starts its copies now and is polled (:class:`~kvtier.transfer.polled.PolledLoads`). Else,
        with ``load_inline``, a local-tier load runs now, on this thread, unless the step computes other
        requests (``busy``: they would wait for it) or the load thread has one (they run in order; see
        :class:`~kvtier.transfer.TierWorker`)."""
        local = job.remote is None
        if local and self._polled is not None and (polled := self._polled.start(job)) is not None:
            return polled
        if local and self.load_inline and not busy and self._last_local.done():
            self._load_and_report(job)
            return self._last_local
        future = (self._load_pool if local else self._remote_pool).submit(self._load_and_report, job)
        if local:
            self._last_local = future
        return future

    @torch.inference_mode()
    def _load_and_report(self, job: LoadJob) -> None:
        mark(job.req_id, "load began")
        local = job.remote is None  # a transfer may wait on its producer: saves need not yield to it
        if local:  # only local loads touch it: a remote thread's `+= 0` could write back a stale count
            self._loads_running += 1
        try:
            if self.load_stream is None:
                failed = self.load(job)
            else:
                if (reuse_after := self.reuse_after()) is not None:
                    self.load_stream.wait_event(reuse_after)
                    if not local:
                        reuse_after.synchronize()
                with torch.cuda.stream(self.load_stream):
                    failed = self.load(job)
                self.load_stream.synchronize()  # the blocks are whole before the request resumes
        except Exception:
            logger.exception("kvtier: load for request %s failed; its blocks will be recomputed", job.req_id)
            failed = set(job.block_ids)
        finally:
            if local:
                self._loads_running -= 1
            self._cancelled.discard(job.req_id)
        mark(job.req_id, "load ended")
        self.finished.put((job.req_id, failed))

    def load(self, job: LoadJob) -> set[int]:
        """Load ``job`` now. Returns the engine block ids that were not loaded (empty on success).

        A chunk that is gone or fails verification ends the load there: it and every later block
        are reported failed, and a corrupt chunk is removed from the store so that no later
        lookup offers it again.
        """
        start = now_ms()
        spans, buffers, sums, tiers, done = [], [], [], [], 0
        copies: list = []  # started scatters, in span order: each has wait() -> ok per span
        launched, begin = 0, None
        local = job.keys if job.remote is None else job.keys[: job.remote.first_chunk]
        if len(local) > 1:  # disk-resident chunks (or other TP sizes' pieces): read ahead all at once
            self.store.will_need(pieces.to_read(self.layout, self.store, local))
        ids = self.ids(job.block_ids)  # one host-to-device copy, before any chunk copy is in flight
        try:
            for i, key in enumerate(local):
                if done == len(job.block_ids):
                    break
                first, count = self.span(job, i, done)
                fetched = self.fetch(key)
                if fetched is None:
                    # The blocks from here on are recomputed and saved again, but a later chunk
                    # still indexed on disk would be skipped as stored: if its file went the way
                    # of this one (deleted, cut short), forget it now so the save replaces it.
                    self.store.drop_unreadable([self.skey(k) for k in local[i + 1:]])
                    break
                buffer, checksum = fetched
                if isinstance(buffer, pieces.Taken):  # scattered straight from the pieces, each checked as it goes
                    buffers += buffer.buffers
                    spans.append(PieceSpan(tuple(zip(buffer.way, (piece.data for piece in buffer.buffers))),
                                           self.chunk_blocks, first, ids[done : done + count]))
                else:
                    buffers.append(buffer)
                    spans.append(ChunkSpan(buffer.data, self.chunk_blocks, first, ids[done : done + count]))
                sums.append(checksum)
                tiers.append(buffer.tier.value)
                done += count
                pending = (len(spans) - launched) * self.chunk_bytes
                if self.scatter_async is not None and pending >= self._pipeline_bytes:
                    begin = now_ms() if begin is None else begin
                    copies.append(self.start_scatter(spans[launched:], sums[launched:]))
                    launched = len(spans)
            if launched < len(spans):
                begin = now_ms() if begin is None else begin
                copies.append(self.start_scatter(spans[launched:], sums[launched:]))
            ok = [flag for copy in copies for flag in copy.wait()]
            if spans:
                if not all(ok):
                    done = self.first_bad(job, spans, ok)
                per_chunk = (now_ms() - begin) * self.chunk_blocks / max(1, done)
                self.cost.scattered(per_chunk)
        finally:
            for copy in copies:  # no buffer goes back while a copy may still read it
                try:
                    copy.wait()
                except Exception:  # noqa: BLE001 - the load already failed; nothing reads these blocks
                    pass
            for buffer in buffers:
                buffer.release()
        loaded, tokens = self._intact(spans, tiers, done)
        if job.remote is not None and len(local) == loaded and done < len(job.block_ids):
            local_done = done
            done, remote_chunks = self._load_remote(job, done)
            tokens["remote"] = (done - local_done) * self.layout.block_size
            loaded += remote_chunks
        return self._count(job, done, loaded, tokens, start)

    def account(self, job: LoadJob, spans: list[ChunkSpan], tiers: list[str], done: int, start: float) -> set[int]:
        """Count a local load whose first ``done`` blocks came intact (``spans`` from ``tiers``, begun
        at ``start`` ms); returns the engine block ids not loaded."""
        return self._count(job, done, *self._intact(spans, tiers, done), start)

    def _intact(self, spans: list[ChunkSpan], tiers: list[str], done: int) -> tuple[int, dict[str, int]]:
        """(Chunks scattered intact within the first ``done`` blocks, tokens per tier): one failing the
        kernel's check is no hit."""
        tokens = {"cpu": 0, "disk": 0, "shared": 0, "remote": 0}
        loaded = blocks = 0
        for span, tier in zip(spans, tiers):
            blocks += span.block_ids.numel()
            if blocks > done:
                break
            tokens[tier] += span.block_ids.numel() * self.layout.block_size
            loaded += 1
        return loaded, tokens

    def _count(self, job: LoadJob, done: int, loaded: int, tokens: dict[str, int], start: float) -> set[int]:
        stats = self.stats
        stats.loaded_chunks += loaded
        stats.loaded_bytes += done * self.layout.bytes_per_block
        stats.hit(tokens)
        elapsed = now_ms() - start
        stats.load_ms += elapsed
        self.batch_ms.append(elapsed)
        logger.debug("kvtier: request %s loaded %d of %d blocks (%s) in %.1f ms on %s", job.req_id, done, len(job.block_ids),
                     ", ".join(f"{n} tokens from {t}" for t, n in tokens.items() if n), elapsed, threading.current_thread().name)
        if done < len(job.block_ids):
            stats.failed_chunks += 1
        return set(job.block_ids[done:])

    def span(self, job: LoadJob, i: int, done: int) -> tuple[int, int]:
        """(first block within chunk ``i`` of ``job``, blocks loaded from it) when ``done`` are loaded."""
        first = job.first_block if i == 0 else 0
        return first, min(self.num_blocks(job, i) - first, len(job.block_ids) - done)

    def num_blocks(self, job: LoadJob, i: int) -> int:
        return job.tail_blocks if job.tail_blocks and i == len(job.keys) - 1 else self.chunk_blocks

    def _load_remote(self, job: LoadJob, done: int) -> tuple[int, int]:
        """Fetch ``job``'s producer chunks, scatter each as it comes (the next on the wire meanwhile), keep full
        ones in the CPU tier; (blocks loaded in all, chunks from the producer). One that landed in the engine's
        blocks failing its KVSUM64 comes again, with those after it, from the producer's CPU tier."""
        first = job.remote.first_chunk
        done, count_chunks, mismatch = remote_pass(self, job, done, first, land=self.landed is not None)
        if mismatch and done < len(job.block_ids):
            done, more, _ = remote_pass(self, job, done, first + count_chunks, land=False)
            count_chunks += more
        return done, count_chunks

    def start_scatter(self, spans: list[ChunkSpan], sums: list[int]):
        """Start scattering ``spans`` (checked against their chunks' KVSUM64s ``sums`` when the
        backend verifies while copying); returns what ``wait()`` gives ``ok`` per span."""
        expected = sums if self.kernel_sums else None
        if self.scatter_async is not None:
            return self.scatter_async(self.layout, spans, expected)
        ok = self._scatter(self.layout, spans, expected) if expected is not None else self._scatter(self.layout, spans)
        return Copied(ok if expected is not None else [True] * len(spans))

    def first_bad(self, job: LoadJob, spans: list[ChunkSpan], ok: list[bool]) -> int:
        """Blocks loaded intact before the first chunk the copy found corrupt, which is removed.
        From that chunk on every block counts as failed: vLLM recomputes from the first failed
        block, and the bad chunk's blocks hold garbage until then."""
        bad = ok.index(False)
        if isinstance(spans[bad], PieceSpan):  # which piece failed is not known: none of them is kept
            for heads, _ in spans[bad].pieces:
                pieces.unusable(self.layout, self.store, job.keys[bad], heads, "a payload checksum mismatch in the copy")
        else:
            self._discard(job.keys[bad], "payload checksum mismatch in the copy kernel")
        return sum(span.block_ids.numel() for span in spans[:bad])

    def _discard(self, key: bytes, reason: str) -> None:
        """Remove a corrupt chunk so no later lookup offers it (the store's watcher reports it gone)."""
        self.store.remove(self.skey(key))
        logger.warning("kvtier: stored chunk %s is unusable (%s); removed it and recomputing.", key.hex(), reason)

    def fetch(self, key: bytes, cpu_only: bool = False
              ) -> tuple[ChunkBuffer, int] | tuple[pieces.Taken, tuple[int, ...]] | None:
        """The stored chunk for chain key ``key`` and its header checksum, or None (missing or
        corrupt; ``cpu_only``: or not in the CPU tier, said nowhere). The payload is verified here
        unless the copy kernel verifies it while loading. Where only another TP size's pieces hold
        it, on a CPU engine: those pieces and their checksums, for the copy to check as it goes."""
        skey = self.skey(key)
        start = now_ms()
        buffer = self.store.get(skey, cpu_only=cpu_only)
        if buffer is None and cpu_only:
            return None  # (a chunk joined from another TP size's pieces is joined on the load thread)
        taken = None
        if buffer is None and self.scatters_pieces:
            taken = pieces.take(self.layout, self.store, key, self.chunk_blocks)
            if taken is None:
                return self._evicted(key)
            if taken.kvsum64 and cpu_pieces.aligned(self.layout, taken.way, self.chunk_blocks):  # as they are
                self.cost.fetched(taken.tier.value, now_ms() - start)
                if taken.tier in (Tier.DISK, Tier.SHARED):
                    self.on_held(taken.skeys)  # promoted into the CPU tier
                return taken, tuple(header.checksum for header in taken.headers)
        buffer = buffer or pieces.assemble(self.layout, self.store, key, self.chunk_blocks, self.on_held, taken)
        if buffer is None:
            return self._evicted(key)
        try:
            header = codec.verify_chunk(buffer.data, self.layout, self.chunk_blocks, payload=not self.kernel_sums)
        except codec.ChunkError as exc:
            buffer.release()
            self._discard(key, str(exc))
            return None
        self.cost.fetched(buffer.tier.value, now_ms() - start)
        if buffer.tier in (Tier.DISK, Tier.SHARED):
            self.on_held([skey])  # promoted into the CPU tier
        return buffer, header.checksum

    @staticmethod
    def _evicted(key: bytes) -> None:
        logger.warning("kvtier: chunk %s was evicted before it could be loaded; recomputing.", key.hex())

    def take_finished(self) -> tuple[set[str], set[int]]:
        """Requests whose loads ended since the last call, and the block ids that failed."""
        req_ids: set[str] = set()
        failed: set[int] = set()
        if self._polled is not None:
            self._polled.poll()
        while True:
            try:
                req_id, bad = self.finished.get_nowait()
            except queue.Empty:
                return req_ids, failed
            mark(req_id, "load reported")
            req_ids.add(req_id)
            failed |= bad

    def cancel(self, req_id: str) -> None:
        """Stop ``req_id``'s P/D transfer (the request was aborted); it still reports, failed."""
        self._cancelled.add(req_id)

    def cancelled(self, req_id: str) -> bool:
        return req_id in self._cancelled

    def wait_finished(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a load to end, the interpreter free meanwhile; what ended
        stays for :meth:`take_finished`."""
        if not self.finished.empty():
            return
        if self._polled is not None and self._polled.wait(timeout_s):
            return
        try:
            self.finished.put(self.finished.get(timeout=timeout_s))
        except queue.Empty:
            pass

    def drain(self) -> None:
        """Wait for every submitted load, local and remote."""
        if self._polled is not None:
            self._polled.drain()
        self._load_pool.submit(lambda: None).result()
        for _ in range(REMOTE_THREADS):  # each remote thread takes one barrier: all earlier transfers ended
            self._remote_pool.submit(self._remote_barrier.wait)
        self._remote_barrier.wait()

    def close(self) -> None:
        """Finish pending loads, then stop the load and remote threads."""
        if self._polled is not None:
            self._polled.drain()
        self._load_pool.shutdown(wait=True)
        self._remote_pool.shutdown(wait=True)

