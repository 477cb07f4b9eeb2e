"""Load and save jobs, and the worker that runs them between engine blocks and the tiers.

Engine-agnostic: the vLLM adapter turns its metadata into :class:`LoadJob` / :class:`SaveJob`;
benches and GPU tests drive :class:`TierWorker` directly. Loads and saves run on separate
single-thread executors, so a latency-critical load never queues behind a burst of saves.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvtier import codec
from kvtier.keys import storage_key
from kvtier.layout import Layout
from kvtier.ops import ChunkSpan, pick_backend
from kvtier.storage import ChunkBuffer, ChunkStore

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferStats:
    """Counters since start (tokens, bytes, milliseconds)."""

    loaded_chunks: int = 0
    loaded_bytes: int = 0
    load_ms: float = 0.0
    failed_chunks: int = 0
    saved_chunks: int = 0
    saved_bytes: int = 0
    save_ms: float = 0.0
    skipped_saves: int = 0
    dropped_saves: int = 0


@dataclass(slots=True)
class _Finished:
    req_ids: set[str] = field(default_factory=set)
    failed_block_ids: set[int] = field(default_factory=set)


class TierWorker:
    """Runs load and save jobs for one worker's ``layout`` against ``store``.

    ``chunk_blocks``: engine blocks per chunk. ``backend``: ops backend name (``auto`` picks the
    fastest for the layout's device).
    """

    def __init__(self, layout: Layout, store: ChunkStore, chunk_blocks: int, backend: str = "auto"):
        self.layout = layout
        self.store = store
        self.chunk_blocks = chunk_blocks
        self.chunk_bytes = codec.chunk_bytes(layout, chunk_blocks)
        self._gather, self._scatter = pick_backend(layout, backend)
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
        self._save_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-save")
        self._lock = threading.Lock()  # guards _finished and _saving only; never held during a copy
        self._finished = _Finished()
        self._saving: set[bytes] = set()
        self.stats = TransferStats()

    def _skey(self, key: bytes) -> bytes:
        return storage_key(key, self.layout.fingerprint)

    def _ids(self, block_ids) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64, device=self.layout.device)

    # ---- lookup -------------------------------------------------------------------------------
    def prefix_tiers(self, keys: list[bytes]) -> list[str]:
        """Tier names of the leading stored chunks of ``keys`` (what the lookup server answers)."""
        return [tier.value for tier in self.store.prefix_hits([self._skey(k) for k in keys])]

    # ---- save ---------------------------------------------------------------------------------
    def save(self, jobs: list[SaveJob]) -> list[Future]:
        """Copy the jobs' blocks out now (the engine may reuse them after this returns); seal
        and store them in the background. Chunks already stored or being stored are skipped."""
        spans, keys, buffers = [], [], []
        for job in jobs:
            for i, key in enumerate(job.keys):
                skey = self._skey(key)
                with self._lock:
                    busy = skey in self._saving
                if busy or self.store.contains(skey) is not None:
                    self.stats.skipped_saves += 1
                    continue
                buffer = self.store.allocate(self.chunk_bytes)
                if buffer is None:
                    self.stats.dropped_saves += 1
                    continue
                ids = job.block_ids[i * self.chunk_blocks : (i + 1) * self.chunk_blocks]
                spans.append(ChunkSpan(buffer.data, self.chunk_blocks, 0, self._ids(ids)))
                keys.append(skey)
                buffers.append(buffer)
        if not spans:
            return []
        start = _now_ms()
        self._gather(self.layout, spans)
        self.stats.save_ms += _now_ms() - start
        with self._lock:
            self._saving.update(keys)
        return [self._save_pool.submit(self._seal_and_put, keys, buffers)]

    @torch.inference_mode()  # buffers may be inference tensors made on the engine's thread
    def _seal_and_put(self, keys: list[bytes], buffers: list[ChunkBuffer]) -> None:
        start = _now_ms()
        try:
            for buffer in buffers:
                codec.write_header(buffer.data, self.layout, self.chunk_blocks)
            self.store.put(keys, buffers)
            self.stats.saved_chunks += len(keys)
            self.stats.saved_bytes += len(keys) * self.chunk_bytes
        except Exception:
            logger.exception("kvtier: saving %d chunks failed; they will be recomputed when needed", len(keys))
            for buffer in buffers:
                buffer.release()
        finally:
            self.stats.save_ms += _now_ms() - start
            with self._lock:
                self._saving.difference_update(keys)

    # ---- load ---------------------------------------------------------------------------------
    def submit_load(self, job: LoadJob) -> Future:
        """Load in the background; the outcome is reported by :meth:`take_finished`."""
        return self._load_pool.submit(self._load_and_report, job)

    @torch.inference_mode()
    def _load_and_report(self, job: LoadJob) -> None:
        try:
            failed = self.load(job)
        except Exception:
            logger.exception("kvtier: load for request %s failed; its blocks will be recomputed", job.req_id)
            failed = set(job.block_ids)
        with self._lock:
            self._finished.req_ids.add(job.req_id)
            self._finished.failed_block_ids.update(failed)

    def load(self, job: LoadJob) -> set[int]:
        """Load ``job`` now. Returns the engine block ids that were not loaded (empty on success).

        A chunk that is gone or fails verification ends the load there: it and every later block
        are reported failed, and a corrupt chunk is removed from the store so that no later
        lookup offers it again.
        """
        start = _now_ms()
        spans, buffers, done = [], [], 0
        try:
            for i, key in enumerate(job.keys):
                if done == len(job.block_ids):
                    break
                first = job.first_block if i == 0 else 0
                count = min(self.chunk_blocks - first, len(job.block_ids) - done)
                buffer = self._fetch(key)
                if buffer is None:
                    break
                buffers.append(buffer)
                ids = self._ids(job.block_ids[done : done + count])
                spans.append(ChunkSpan(buffer.data, self.chunk_blocks, first, ids))
                done += count
            if spans:
                self._scatter(self.layout, spans)
        finally:
            for buffer in buffers:
                buffer.release()
        self.stats.loaded_chunks += len(spans)
        self.stats.loaded_bytes += done * self.layout.bytes_per_block
        self.stats.load_ms += _now_ms() - start
        if done < len(job.block_ids):
            self.stats.failed_chunks += 1
        return set(job.block_ids[done:])

    def _fetch(self, key: bytes) -> ChunkBuffer | None:
        """The verified stored chunk for chain key ``key``, or None (missing or corrupt)."""
        skey = self._skey(key)
        buffer = self.store.get(skey)
        if buffer is None:
            logger.warning("kvtier: chunk %s was evicted before it could be loaded; recomputing.", key.hex())
            return None
        try:
            codec.verify_chunk(buffer.data, self.layout, self.chunk_blocks)
        except codec.ChunkError as exc:
            buffer.release()
            self.store.remove(skey)
            logger.warning("kvtier: stored chunk %s is unusable (%s); removed it and recomputing.", key.hex(), exc)
            return None
        return buffer

    def take_finished(self) -> tuple[set[str], set[int]]:
        """Requests whose loads ended since the last call, and the block ids that failed."""
        with self._lock:
            finished, self._finished = self._finished, _Finished()
        return finished.req_ids, finished.failed_block_ids

    def drain(self) -> None:
        """Wait for every submitted load and save."""
        for pool in (self._load_pool, self._save_pool):
            pool.submit(lambda: None).result()

    def close(self) -> None:
        """Finish pending work, then stop the executors. The store is closed by its owner."""
        self._load_pool.shutdown(wait=True)
        self._save_pool.shutdown(wait=True)


def _now_ms() -> float:
    return time.perf_counter() * 1e3
