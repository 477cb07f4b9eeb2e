"""kvtier's side of LMCache's LocalDiskBackend: hooks on it, write tracking, exact reads
(O_DIRECT ones in parallel parts, see :mod:`._direct`, and read ahead for a load, see
:mod:`._ahead`), index entry removal with correct accounting, and the index rebuild at start.

Sizes are in bytes. Chunk files hold exactly the chunk's bytes (written by LMCache's
write_file) and are named by :func:`kvtier.storage._lmcache.file_name`.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from . import _lmcache as lm
from ._ahead import ReadAhead
from ._direct import NO_DIRECT, PART_BYTES, WHOLE_FILE, DirectReader, memory_backed, size_problem
from ._probe import DiskSpeed, measure_read_speed, unlink_quietly, will_need
from .types import StoreConfig

logger = logging.getLogger(__name__)


class DiskTier:
    """Wraps one LocalDiskBackend (owned by the StorageManager; closed by it).

    Hooks go on the backend instance, never its class, so other LMCache users in the process
    are unaffected:

    * File names carry the chunk size: LMCache's own name has no size, and a restart needs it
      to tell a truncated file from a whole one.
    * A failed write (disk full, directory gone) logs one line, deletes the partial file and
      drops the key from the index. Upstream would raise inside its worker and leak the chunk's
      CPU reference; the CPU copy is untouched either way.
    * Every finished write attempt is counted and signalled, so callers wait instead of poll.
    * ``on_change(key)``, when set, hears of every key whose disk copy appeared or went (a write
      landed or failed, an eviction, a drop). It runs on LMCache's threads, sometimes under the
      disk lock: it must only record the key.

    The tier owns a :class:`DirectReader` (a few threads reading files: with O_DIRECT where
    ``config.o_direct``, else through the page cache, and so once the file system refuses O_DIRECT)
    and, with O_DIRECT or on a file system in memory (tmpfs), reads each file in parallel parts and
    keeps a :class:`ReadAhead` that fills buffers from ``alloc(nbytes, wait_s)`` (the CPU pool's);
    both end when LMCache closes the backend, before the CPU pool is freed. Reads for no load
    (``read(..., background=True)``: promotions) go to a second reader of the same kind, so that
    a load's parts never queue behind theirs. ``cpu``: the CPU backend, asked which keys it holds
    so that read-ahead skips them.
    """

    def __init__(self, backend: lm.LocalDiskBackend, config: StoreConfig, align: int, cpu: Any = None,
                 alloc: Callable[[int, float], Any] | None = None) -> None:
        self.backend = backend
        self._cpu = cpu
        # In parallel parts and read ahead with O_DIRECT or from memory; a disk through the page
        # cache reads each file whole, as before, the kernel reading the whole load ahead (WILLNEED).
        parallel = config.o_direct or memory_backed(backend.path)
        self._reader = DirectReader(direct=config.o_direct, part_bytes=PART_BYTES if parallel else WHOLE_FILE)
        self._background = DirectReader(direct=config.o_direct, part_bytes=self._reader.part_bytes)  # promotions
        self._ahead = None
        if parallel and cpu is not None and alloc is not None:
            self._ahead = ReadAhead(self._reader, backend, lambda n: alloc(n, 0.0), self._read_failed,
                                    max_bytes=config.cpu_bytes // 4)
        self._config = config
        self._align = align  # CPU pool alignment: a chunk's disk size is its aligned pool size
        self._cond = threading.Condition()
        self.writes_done = 0  # only grows; read without the lock to snapshot progress
        self._warned_too_big = False
        self.on_change: Callable[[Any], None] | None = None
        # LMCache's _key_to_path only receives the key; the size rides along in a thread-local,
        # which works because each write runs start to end on one worker thread.
        self._tls = threading.local()
        self._orig_key_to_path = backend._key_to_path
        self._orig_write_file = backend.write_file
        self._orig_save = backend.async_save_bytes_to_disk
        self._orig_remove = backend.remove
        self._orig_close = backend.close
        backend._key_to_path = self._key_to_path  # type: ignore[method-assign]
        backend.write_file = self._write_file  # type: ignore[method-assign]
        backend.async_save_bytes_to_disk = self._save  # type: ignore[method-assign]
        backend.remove = self._remove  # type: ignore[method-assign]  (LMCache's own eviction)
        backend.close = self._close  # type: ignore[method-assign]

    # ------------------------------------------------------------------ writes

    def submit(self, keys: list[Any], objs: list[Any]) -> None:
        """Queue write-through of chunks already stored in CPU; never raises."""
        cap = self.backend.max_cache_size
        if not self._warned_too_big and any(o.get_physical_size() > cap for o in objs):
            self._warned_too_big = True  # once per store: it is a sizing problem, not an event
            logger.warning("chunks larger than disk_bytes=%d are kept in CPU only", cap)
        try:
            # Takes its own reference per queued write; skips keys already on disk or in flight.
            self.backend.batched_submit_put_task(keys, objs)
        except Exception as exc:  # noqa: BLE001 - the CPU copies are stored; disk is best effort
            logger.warning("disk write-through of %d chunks not submitted: %s", len(keys), exc)

    def write_pending(self, ek: Any) -> bool:
        return self.backend.exists_in_put_tasks(ek)

    def writes_pending(self) -> bool:
        return bool(self.backend.disk_worker.put_tasks)

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait (re-checking after each finished write) until ``predicate()``; False on timeout."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def _key_to_path(self, key: Any) -> str:
        nbytes = getattr(self._tls, "nbytes", None)
        if nbytes is None:  # not one of our writes; keep LMCache's naming
            return self._orig_key_to_path(key)
        return os.path.join(self.backend.path, lm.file_name(key, nbytes))

    def _write_file(self, buffer: Any, path: str) -> None:
        try:
            self._orig_write_file(buffer, path)
        except Exception as exc:  # noqa: BLE001 - any failure means "not on disk"
            self._tls.failed = True
            logger.warning("disk write failed, chunk kept in CPU only: %s (%s)", path, exc)
            unlink_quietly(path)

    def _save(self, key: Any, memory_obj: Any, on_complete_callback: Any = None) -> None:
        self._tls.nbytes = memory_obj.get_size()
        self._tls.failed = False
        try:
            # With write_file no longer raising, upstream always releases the chunk's reference,
            # indexes the key and clears its in-flight marker; a failed write is dropped after.
            self._orig_save(key=key, memory_obj=memory_obj, on_complete_callback=on_complete_callback)
            if self._tls.failed:
                self.drop(key)
        except Exception:  # noqa: BLE001 - runs on an LMCache worker; nobody else would see it
            logger.exception("disk write of a chunk failed unexpectedly")
        finally:
            self._tls.nbytes = None
            with self._cond:
                self.writes_done += 1
                self._cond.notify_all()
            self._changed(key)

    def _remove(self, key: Any, force: bool = True) -> Any:
        removed = self._orig_remove(key, force)
        if self._ahead is not None:
            self._ahead.discard(key)
        self._changed(key)
        return removed

    def _close(self) -> None:
        # Every read has ended, and every buffer read ahead is back in the pool, before LMCache
        # closes the backend (and the store then frees the pool).
        if self._ahead is not None:
            self._ahead.close()
        if self._reader is not None:
            self._reader.close()
            self._background.close()
        self._orig_close()

    def _changed(self, key: Any) -> None:
        if self.on_change is not None:
            self.on_change(key)

    # ------------------------------------------------------------------ reads and removal

    def read(self, ek: Any, alloc: Callable[[int], Any], background: bool = False) -> Any:
        """The chunk read into ``alloc(nbytes)``'s buffer (+1 reference, the caller's), or None.

        Reads the file here rather than via LocalDiskBackend.get_blocking: that path allocates
        with an unbounded busy loop, and its read_file ignores a missing file (returning an
        unread buffer) and drops the index entry without fixing the capacity accounting.
        None if the key is not on disk, ``alloc`` returns None, or the file is bad (then the
        entry and file are dropped with a warning). A chunk read ahead is taken as it is.
        ``background``: a read no load waits for, on the tier's second reader.
        """
        if self._ahead is not None and (obj := self._ahead.claim(ek)) is not None:
            return obj
        disk = self.backend
        with disk.disk_lock:
            meta = disk.dict.get(ek)
            if meta is None:
                return None
            meta.pin()  # LMCache's disk eviction skips pinned entries (it deletes their files)
        ok = False
        nbytes = int(meta.shape.numel())
        try:
            obj = None
            # Checked before allocating too, so a broken file does not evict a good CPU chunk.
            problem = size_problem(meta.path, nbytes)
            if problem is None:
                obj = alloc(nbytes)
                if obj is None:
                    return None
                problem = self._read_into(meta.path, obj.byte_array, self._background if background else self._reader)
            if problem is None:
                ok = True
                return obj
            if obj is not None:
                obj.ref_count_down()
            # Already gone from the index means remove() raced us and deleted it on purpose.
            if self.drop(ek, meta):
                logger.warning("dropping disk chunk %s: %s", meta.path, problem)
            return None
        finally:
            with disk.disk_lock:
                meta.unpin()
                if ok and disk.dict.get(ek) is meta:
                    disk.cache_policy.update_on_hit(ek, disk.dict)

    def drop_if_unreadable(self, ek: Any) -> bool:
        """Drop ``ek`` (index entry and file) if its file is missing or not its chunk's size: a
        stat, no read. True if dropped. Pinned entries (a read in progress) are left alone."""
        disk = self.backend
        with disk.disk_lock:
            meta = disk.dict.get(ek)
            if meta is None or meta.pin_count > 0:
                return False
        problem = size_problem(meta.path, int(meta.shape.numel()))
        if problem is None or not self.drop(ek, meta):
            return False
        logger.warning("dropping disk chunk %s: %s", meta.path, problem)
        return True

    def will_need(self, eks: list[Any]) -> None:
        """Start reading these chunks now: those not in the CPU tier are read ahead into CPU pool
        buffers, in ``eks``' order, several at once in parallel parts (see :mod:`._ahead`); a
        load's reads then find them there instead of waiting for the device, or one core's copy
        out of the page cache, one file at a time. Buffered, the kernel is also told to read every
        file now (``POSIX_FADV_WILLNEED``): the device sees the whole load at once, not the
        read-ahead's few chunks. Unknown keys and errors are ignored; a hint, never needed."""
        if self._ahead is not None and self._ahead.refused:
            self._buffered()
        if self._cpu is not None:
            with self._cpu.cpu_lock:
                eks = [ek for ek in eks if ek not in self._cpu.hot_cache]
        with self.backend.disk_lock:
            metas = [(ek, meta) for ek in eks if (meta := self.backend.dict.get(ek)) is not None]
        if not self._reader.direct:  # the kernel reads every file at once; the read-ahead copies them out
            will_need([meta.path for _, meta in metas])
        if self._ahead is not None:
            self._ahead.want([ek for ek, _ in metas])

    def read_speed(self) -> DiskSpeed | None:
        """The tier's read speed, measured now from its least recently used chunk files (a
        scratch file when it holds none), through the path its reads take: see :mod:`._probe`."""
        with self.backend.disk_lock:
            paths = [meta.path for meta in self.backend.dict.values()]  # LRU order: oldest first
        return measure_read_speed(self.backend.path, paths, self._config.o_direct, reader=self._reader)

    def drop(self, ek: Any, expected: Any = None) -> bool:
        """Remove ``ek`` from the index and delete its file; False if not indexed (or indexed
        with an entry other than ``expected``).

        Not LocalDiskBackend.remove: it leaves current_cache_size (its capacity check) counting
        the chunk forever. The file goes under the lock so that a new write of the same key
        cannot be deleted by mistake.
        """
        disk = self.backend
        with disk.disk_lock:
            meta = disk.dict.get(ek)
            if meta is None or (expected is not None and meta is not expected):
                return False
            del disk.dict[ek]
            disk.current_cache_size -= meta.size
            disk.usage -= meta.size
            disk.cache_policy.update_on_force_evict(ek)
            try:
                os.unlink(meta.path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("could not delete disk chunk %s: %s", meta.path, exc)
        if self._ahead is not None:
            self._ahead.discard(ek)
        self._changed(ek)
        return True

    def _read_failed(self, ek: Any, meta: Any, problem: str) -> None:
        """A read ahead found ``ek``'s file bad: the chunk is dropped, as a get would drop it."""
        if self.drop(ek, meta):
            logger.warning("dropping disk chunk %s: %s", meta.path, problem)

    def _read_into(self, path: str, buf: memoryview, reader: DirectReader) -> str | None:
        problem = reader.read(path, buf)
        if problem != NO_DIRECT:
            return problem
        self._buffered()
        return reader.read(path, buf)

    def _buffered(self) -> None:
        """The file system refused O_DIRECT: read through the page cache from now on (said once)."""
        if self._reader.direct:
            self._reader.direct = self._background.direct = False
            logger.warning("O_DIRECT reads are not supported under %s; reading through the page cache",
                           self.backend.path)
        if self._ahead is not None:
            self._ahead.refused = False

    # ------------------------------------------------------------------ restart

    def rebuild_index(self) -> None:
        """Index the chunk files a previous store left behind (LMCache's index lives in memory
        only). Files of the wrong size are deleted with a warning, and so are the oldest files
        beyond disk_bytes; files of other namespaces or workers, and foreign files, stay."""
        disk = self.backend
        found = []
        for entry in os.scandir(disk.path):
            parsed = lm.parse_file_name(entry.name, self._config)
            if parsed is None or not entry.is_file(follow_symlinks=False):
                continue
            ek, nbytes = parsed
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            size, mtime = st.st_size, st.st_mtime_ns
            if size != nbytes:
                logger.warning(
                    "deleting disk chunk %s: %d bytes on disk, %d expected", entry.path, size, nbytes
                )
                unlink_quietly(entry.path)
                continue
            found.append((mtime, entry.path, ek, nbytes))
        found.sort(key=lambda f: (f[0], f[1]), reverse=True)  # newest first: they win on overflow
        kept, total = [], 0
        for _, path, ek, nbytes in found:
            phys = -(-nbytes // self._align) * self._align  # what a fresh write would count
            if total + phys > disk.max_cache_size:
                logger.warning("deleting disk chunk %s: beyond disk_bytes", path)
                unlink_quietly(path)
                continue
            total += phys
            kept.append((ek, nbytes, phys))
        for ek, nbytes, phys in reversed(kept):  # oldest first = least recently used
            self._tls.nbytes = nbytes  # insert_key derives the path through _key_to_path
            try:
                disk.insert_key(ek, phys, lm.chunk_shape(nbytes), lm.KEY_DTYPE, lm.KEY_FMT)
            finally:
                self._tls.nbytes = None
        with disk.disk_lock:
            disk.current_cache_size += total
            disk.usage += total
        if kept:
            logger.info("disk tier %s: restored %d chunks (%d bytes)", disk.path, len(kept), total)


def check_writable_dir(path: str) -> str | None:
    """Create ``path`` if missing and prove it writable; the OS's reason if not, else None."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".kvtier-probe-{os.getpid()}-{threading.get_ident()}")
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None
