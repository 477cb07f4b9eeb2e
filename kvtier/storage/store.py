"""ChunkStore: kvtier's CPU + disk + shared chunk cache, one adapter over LMCache's StorageManager.

Sizes are in bytes. A chunk is an opaque byte string under an opaque key. The CPU tier is an
LRU pool; the disk tier is written through at put time (asynchronously, on LMCache's disk
workers) and is rebuilt from its files when a store starts on an existing directory. The shared
tier (a Redis/Valkey server, through LMCache's RemoteBackend) is written through too, in the
background, and read last; its hits are promoted into CPU like disk hits.

The module is one piece: every method of :class:`ChunkStore` moves chunks between the same tiers
under the same reference counts and locks (who owns a buffer, the CPU pool's LRU order, writes in
flight), and each tier's own work already lives in ``_disk``, ``_shared`` and ``_lmcache``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from typing import Callable, Iterable

import torch

from . import _lmcache as lm
from ._disk import DiskTier, check_writable_dir
from ._probe import DiskSpeed
from ._shared import SharedTier, _ReadAllocator
from .types import ChunkBuffer, StorageError, StoreConfig, Tier

logger = logging.getLogger(__name__)

_TIER_OF_BACKEND = {lm.CPU_BACKEND: Tier.CPU, lm.DISK_BACKEND: Tier.DISK}
# How long allocate()/get() wait for in-flight disk writes to make CPU chunks evictable, and
# remove() for a write of its own key. Writes take milliseconds; this only bounds a stuck disk.
_WRITE_WAIT_S = 10.0
SHARED_PASSWORD_ENV = "KVTIER_SHARED_PASSWORD"  # the shared server's password, when the URL has none
_open_stores: weakref.WeakSet[ChunkStore] = weakref.WeakSet()


def _close_open_stores() -> None:
    """Close every store still open when the interpreter exits. LMCache's event-loop thread is
    not a daemon, so a process whose engine died without closing its store (an exception out of
    the engine loop) would otherwise wait for it forever; closing also lets in-flight disk writes
    land whole."""
    for store in list(_open_stores):
        store.close()


# Runs before the interpreter joins non-daemon threads (the hook concurrent.futures uses).
threading._register_atexit(_close_open_stores)


class ChunkStore:
    """Chunks by key in a CPU LRU pool with an optional write-through disk tier.

    Thread-safe for concurrent calls, except that close() must not race other calls.
    Use as a context manager or call close(): LMCache runs a non-daemon thread.
    """

    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        if config.disk_path is not None:
            problem = check_writable_dir(config.disk_path)
            if problem is not None:
                raise StorageError(f"disk_path '{config.disk_path}' is not writable ({problem}).")
        try:
            self._sm = lm.build_storage_manager(config)
        except (RuntimeError, MemoryError, OSError) as exc:
            raise StorageError(f"cpu_bytes={config.cpu_bytes} could not be allocated: {exc}") from exc
        self._closed = False
        self._close_lock = threading.Lock()
        self._outstanding: weakref.WeakSet[ChunkBuffer] = weakref.WeakSet()
        self._outstanding_lock = threading.Lock()
        self._watcher: Callable[[list[bytes]], None] | None = None
        try:
            self._cpu: lm.LocalCPUBackend = self._sm.storage_backends[lm.CPU_BACKEND]
            self._cpu_remove = self._cpu.remove
            self._cpu.remove = self._remove_from_cpu  # type: ignore[method-assign]  (evictions too)
            pool = self._cpu.get_memory_allocator()
            self._pool = pool.pin_allocator  # TensorMemoryAllocator: the byte accounting
            self._align = int(pool.align_bytes)
            backend = self._sm.storage_backends.get(lm.DISK_BACKEND)
            self._disk = None if backend is None else DiskTier(backend, config, self._align, self._cpu, self._alloc_obj)
            if self._disk is not None:
                self._disk.on_change = self._changed
                self._disk.rebuild_index()
            self._shared = None if config.shared_url is None else self._open_shared(config)
        except BaseException:
            self._sm.close()
            self._shutdown_loop()
            raise
        _open_stores.add(self)

    # ------------------------------------------------------------------ public API

    def allocate(self, nbytes: int, wait: bool = True) -> ChunkBuffer | None:
        """A fresh ``nbytes``-byte buffer from the CPU pool, evicting LRU chunks if needed.

        Returns None, without evicting anything, if ``nbytes`` exceeds the whole pool, and None
        if the pool cannot make room because the chunks are held by readers (LMCache may have
        evicted unheld chunks while trying). Never blocks for long: at most ~10 s waiting for
        in-flight disk writes, which keep their chunks unevictable until they land; with
        ``wait=False`` not at all (None instead, for callers that must not stall).
        The caller owns the buffer: release() it, or pass it to put().
        """
        self._check_open()
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        obj = self._alloc_obj(nbytes, _WRITE_WAIT_S if wait else 0.0)
        return None if obj is None else self._wrap(obj, Tier.CPU)

    def put(self, keys: list[bytes], buffers: list[ChunkBuffer], cpu_only: bool = False) -> None:
        """Store each buffer under its key in CPU and write it through to disk if configured
        (``cpu_only``: to the CPU tier alone, e.g. a chunk joined from pieces stored elsewhere).

        Takes ownership of every buffer (do not release them afterwards). A key already stored
        in any tier, or repeated in this call, is not stored again; its new buffer is released.
        Disk write failures are logged and never raised; the CPU copy stays.
        Raises ValueError, before taking anything, for mismatched lengths or a buffer that is
        released or belongs to another store.
        """
        self._check_open()
        if len(keys) != len(buffers):
            raise ValueError(f"put got {len(keys)} keys but {len(buffers)} buffers")
        eks = [lm.engine_key(k, self._config) for k in keys]
        if len({id(b) for b in buffers}) != len(buffers):
            raise ValueError("put got the same ChunkBuffer twice")
        for b in buffers:
            if b.released or b._on_release != self._forget:
                raise ValueError(f"put got {b!r}, which is released or from another store")
        objs = [b._detach() for b in buffers]

        new_keys: list[lm.CacheEngineKey] = []
        new_objs: list[lm.MemoryObj] = []
        seen: set[lm.CacheEngineKey] = set()
        for ek, obj in zip(eks, objs):
            if ek in seen or self._sm.contains(ek) is not None:
                obj.ref_count_down()
                continue
            seen.add(ek)
            new_keys.append(ek)
            new_objs.append(obj)
        if not new_keys:
            return
        # The backends are called directly instead of StorageManager.batched_put so that a
        # failing disk submit cannot skip the final release of the callers' references.
        try:
            # Each backend takes its own reference; a key stored meanwhile by another thread
            # is skipped there and its buffer freed below.
            self._cpu.batched_submit_put_task(new_keys, new_objs)
            if self._disk is not None and self._config.write_through and not cpu_only:
                self._disk.submit(new_keys, new_objs)
            if self._shared is not None and self._config.write_through and not cpu_only:
                self._shared.submit(new_keys, new_objs)
        finally:
            for obj in new_objs:
                obj.ref_count_down()

    def contains(self, key: bytes) -> Tier | None:
        """The fastest local tier (CPU, disk) holding ``key``, or None. Never asks the shared
        tier: that is a network round trip (see :meth:`shared_prefix`)."""
        self._check_open()
        name = self._sm.contains(lm.engine_key(key, self._config))
        return None if name is None else _TIER_OF_BACKEND.get(name)

    def prefix_hits(self, keys: list[bytes]) -> list[Tier]:
        """Tiers of the leading run of stored keys; stops at the first key not stored.

        Asked per key: StorageManager.batched_contains never returns to CPU after a disk run,
        so [cpu, disk, cpu] would count as two hits there.
        """
        self._check_open()
        tiers: list[Tier] = []
        for key in keys:
            tier = self.contains(key)
            if tier is None:
                break
            tiers.append(tier)
        return tiers

    def get(self, key: bytes, cpu_only: bool = False, background: bool = False) -> ChunkBuffer | None:
        """The chunk's bytes, from CPU if there (refreshing its LRU position), else (unless
        ``cpu_only``) from disk (promoting it into CPU; ``background``: a read no load waits for, see
        ``DiskTier``). None if it is gone (evicted after contains, its file vanished or was truncated),
        or if a disk chunk cannot get CPU room. The caller must release() the buffer and must not
        write to it (the memory is the cached chunk itself)."""
        self._check_open()
        ek = lm.engine_key(key, self._config)
        obj = self._sm.get(ek, location=lm.CPU_BACKEND)  # +1 reference, ours to give away
        if obj is not None:
            # LMCache's get does not touch its LRU order, so a hot chunk would age out.
            with self._cpu.cpu_lock:
                if ek in self._cpu.hot_cache:
                    self._cpu.cache_policy.update_on_hit(ek, self._cpu.hot_cache)
            return self._wrap(obj, Tier.CPU)
        if cpu_only:
            return None
        tier, obj = Tier.DISK, None
        if self._disk is not None:
            obj = self._disk.read(ek, self._alloc_obj, background)
        if obj is None and self._shared is not None:
            tier, obj = Tier.SHARED, self._shared.read(ek)
        if obj is None:
            return None
        # Same promotion StorageManager.get does: the CPU tier takes its own reference
        # (or skips it if another thread promoted or put the key meanwhile).
        self._cpu.submit_put_task(ek, obj)
        return self._wrap(obj, tier)

    def shared_prefix(self, chunks: list[tuple[bytes, ...]], namespaces: tuple[str, ...], timeout_ms: int) -> int:
        """How many leading ``chunks`` the shared tier holds for every rank, in one round trip of
        at most ``timeout_ms`` (0 without a shared tier, while it is down, or on any failure).

        ``chunks[i][r]``: rank r's key of chunk i; ``namespaces[r]``: rank r's store namespace.
        This store's world size applies to every rank (1: every rank's keys are worker 0's)."""
        self._check_open()
        if self._shared is None or not chunks:
            return 0
        world = self._config.world_size
        if len(namespaces) != world > 1 or any(len(row) != len(namespaces) for row in chunks):
            raise ValueError(f"shared_prefix needs one key and namespace per rank ({world})")
        rows = [[lm.engine_key_for(k, ns, r % world, world) for r, (k, ns) in enumerate(zip(row, namespaces))]
                for row in chunks]
        return self._shared.prefix(rows, timeout_ms / 1e3)

    def shared_stats(self) -> dict[str, int]:
        """The shared tier's counters (see ``SharedTier.stats``); empty without one."""
        return {} if self._shared is None else self._shared.stats()

    def will_need(self, keys: Iterable[bytes]) -> None:
        """Hint that ``keys`` are about to be read, in this order: those held only on disk start loading
        now, in parallel (into the page cache; with O_DIRECT, into CPU buffers the gets take). Without
        a disk tier ``keys`` is not iterated (a generator's lookups are never run)."""
        self._check_open()
        if self._disk is not None:
            self._disk.will_need([lm.engine_key(k, self._config) for k in keys])

    def remove(self, key: bytes) -> None:
        """Drop ``key`` from every tier and delete its disk file (e.g. found corrupt).

        Buffers already handed out stay valid until released.
        """
        self._check_open()
        ek = lm.engine_key(key, self._config)
        disk = self._disk
        if disk is not None:
            # An in-flight write would index the key again right after we drop it.
            disk.wait(lambda: not disk.write_pending(ek), _WRITE_WAIT_S)
        self._sm.remove(ek, locations=[lm.CPU_BACKEND])
        if disk is not None:
            disk.drop(ek)
        if self._shared is not None:
            self._shared.remove(ek)

    def drop_unreadable(self, keys: list[bytes]) -> int:
        """Forget the disk copies of ``keys`` whose files are gone or cut short (a stat each, no
        read), so the chunks count as not stored and are saved again; returns how many. For a
        caller that just found one chunk's file broken and expects its neighbours may be too."""
        self._check_open()
        if self._disk is None:
            return 0
        return sum(self._disk.drop_if_unreadable(lm.engine_key(k, self._config)) for k in keys)

    def keys(self) -> list[bytes]:
        """Keys of every chunk stored now, in any tier (e.g. what a restarted disk tier holds)."""
        self._check_open()
        with self._cpu.cpu_lock:
            found = list(self._cpu.hot_cache)
        if self._disk is not None:
            with self._disk.backend.disk_lock:
                found += list(self._disk.backend.dict)
        keys = (lm.key_bytes(ek) for ek in found)
        return list(dict.fromkeys(k for k in keys if k is not None))

    def watch(self, on_change: Callable[[list[bytes]], None] | None) -> None:
        """Call ``on_change([key])`` whenever a chunk may have entered or left a tier outside
        put/get: an LRU eviction, remove(), a disk write that landed or failed, a bad disk file.
        It runs on whichever thread made the change, sometimes under a tier's lock: it must only
        record the keys and look them up later (``contains``). None stops the calls."""
        self._watcher = on_change

    def residency(self, key: bytes) -> tuple[Tier, ...]:
        """Every tier holding ``key`` now (a chunk may be in CPU and on disk at once)."""
        self._check_open()
        ek = lm.engine_key(key, self._config)
        with self._cpu.cpu_lock:
            tiers = (Tier.CPU,) if ek in self._cpu.hot_cache else ()
        if self._disk is not None:
            with self._disk.backend.disk_lock:
                if ek in self._disk.backend.dict:
                    tiers += (Tier.DISK,)
        return tiers

    def disk_read_speed(self) -> DiskSpeed | None:
        """The disk tier's read speed, measured now (at most 64 MiB or 0.3 s; see ``_probe``); None without one."""
        self._check_open()
        return None if self._disk is None else self._disk.read_speed()

    def disk_writes_pending(self) -> bool:
        """A chunk is on its way to the disk tier."""
        return self._disk is not None and self._disk.writes_pending()

    def disk_bytes_used(self) -> int:
        """Bytes the disk tier holds, as its budget counts them (each file's size rounded up to
        the CPU pool's alignment); 0 without a disk tier."""
        return 0 if self._disk is None else int(self._disk.backend.current_cache_size)

    def cpu_bytes_used(self) -> int:
        """Bytes allocated in the CPU pool (4 KiB-aligned chunk sizes): cached chunks plus
        buffers held by callers. 0 after close() or once everything is released and removed."""
        return int(self._pool.total_allocated_size)

    def pool_memory(self) -> tuple[int, int]:
        """``(address, bytes)`` of the CPU pool every buffer of this store lies in (for transfer
        libraries that register memory once, such as NIXL). Freed by close()."""
        buffer = self._pool.buffer
        return buffer.data_ptr(), buffer.numel() * buffer.element_size()

    def close(self) -> None:
        """Stop LMCache's threads and free the pool; idempotent. Waits for in-flight disk writes
        so the directory is complete for the next store. Buffers still held are released and
        emptied (a warning says how many)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            with self._outstanding_lock:
                held = list(self._outstanding)
            for buf in held:
                buf.release()
                buf.data = torch.empty(0, dtype=torch.uint8)
            if held:
                logger.warning("ChunkStore closed with %d unreleased buffers; emptied them", len(held))
            if self._shared is not None:
                self._shared.close(_WRITE_WAIT_S)  # its writes read from the CPU pool too
            if self._disk is not None:
                # StorageManager.close frees the CPU pool before closing the disk backend, whose
                # queued writes still read from it; closing disk first drains them.
                self._sm.close_backend(lm.DISK_BACKEND)
        finally:
            self._sm.close()
            self._shutdown_loop()

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open_shared(self, config: StoreConfig) -> SharedTier:
        timeout_s = config.shared_timeout_ms / 1e3
        url = lm.redis_url(config.shared_url, timeout_s, os.environ.get(SHARED_PASSWORD_ENV))
        allocator = _ReadAllocator(self._cpu, lambda n: self._alloc_obj(n, 0.0))
        # A read makes two GETs, each bounded by the socket timeout, and may queue behind
        # writes: LMCache's own deadline must lie beyond all of that (it abandons a read in
        # a way that can leak its buffer).
        blocking_s = max(2, math.ceil(8 * timeout_s))
        backend = lm.build_remote_backend(config, url, self._sm, allocator, blocking_s)
        write_bytes = config.shared_write_bytes or config.cpu_bytes // 4
        return SharedTier(config.shared_url, backend, allocator, self._sm.loop, timeout_s, write_bytes)

    # ------------------------------------------------------------------ CPU pool

    def _alloc_obj(self, nbytes: int, wait_s: float = _WRITE_WAIT_S) -> lm.MemoryObj | None:
        aligned = -(-nbytes // self._align) * self._align
        if aligned > self._pool.address_manager.get_heap_size():
            # LMCache would evict every chunk before finding out it can never fit.
            return None
        shape = lm.chunk_shape(nbytes)
        deadline = time.monotonic() + wait_s
        disk = self._disk
        while True:
            seen = disk.writes_done if disk is not None else 0
            obj = self._cpu.allocate(shape, lm.KEY_DTYPE, lm.KEY_FMT, eviction=False)
            if obj is not None:
                return obj
            # A chunk with a disk write in flight holds a second reference, so LMCache's
            # eviction would skip it and evict a newer chunk instead: wait for the LRU chunk's
            # write to land so eviction stays in LRU order.
            if wait_s <= 0 or not self._lru_write_pending():
                # busy_loop=False: LMCache's busy loop sleeps forever when nothing is evictable.
                obj = self._cpu.allocate(
                    shape, lm.KEY_DTYPE, lm.KEY_FMT, eviction=True, busy_loop=False
                )
                if obj is not None:
                    return obj
                if disk is None or not disk.writes_pending():
                    return None  # nothing will become evictable by waiting
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not disk.wait(lambda: disk.writes_done != seen, remaining):
                return None

    def _lru_write_pending(self) -> bool:
        if self._disk is None:
            return False
        with self._cpu.cpu_lock:
            lru = next(iter(self._cpu.hot_cache), None)
        return lru is not None and self._disk.write_pending(lru)

    def _flush(self, timeout: float = _WRITE_WAIT_S) -> bool:
        """Wait until no disk or shared-tier write is in flight (for tests and benchmarks); True
        if drained."""
        disk, shared = self._disk, self._shared
        drained = disk is None or disk.wait(lambda: not disk.writes_pending(), timeout)
        return (shared is None or shared.wait_writes(timeout)) and drained

    def _remove_from_cpu(self, key: lm.CacheEngineKey, force: bool = True) -> bool:
        removed = self._cpu_remove(key, force)
        if removed:
            self._changed(key)
        return removed

    def _changed(self, ek: lm.CacheEngineKey) -> None:
        watcher = self._watcher
        key = lm.key_bytes(ek) if watcher is not None else None
        if key is not None:
            watcher([key])

    def _wrap(self, obj: lm.MemoryObj, tier: Tier) -> ChunkBuffer:
        buf = ChunkBuffer(obj.tensor.view(-1), tier, obj, self._forget)
        with self._outstanding_lock:
            self._outstanding.add(buf)
        return buf

    def _forget(self, buf: ChunkBuffer) -> None:
        with self._outstanding_lock:
            self._outstanding.discard(buf)

    # ------------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ChunkStore is closed")

    def _shutdown_loop(self) -> None:
        # StorageManager.close stops its loop but leaves the loop's default executor thread
        # (used for disk writes) alive until interpreter exit.
        loop = self._sm.loop
        try:
            if not loop.is_running() and not loop.is_closed():
                loop.run_until_complete(loop.shutdown_default_executor())
                loop.close()
        except Exception as exc:  # noqa: BLE001 - cleanup only
            logger.debug("LMCache event loop cleanup: %s", exc)


