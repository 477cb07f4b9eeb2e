"""How chunk files are read: in parts of at most ``part_bytes`` read in parallel on a
:class:`DirectReader`'s own threads, each part one ``preadv``, so a fast disk sees several requests
at once and a file in the page cache (or on a tmpfs) is copied by several cores instead of one;
with O_DIRECT (``disk_io="direct"``) or through the page cache.

Sizes and offsets are in bytes. An O_DIRECT read's file offsets, lengths and buffer address must
be multiples of :data:`ALIGN` (the logical block size of every disk in use, 512 or 4096, divides
it). A chunk's size is not (its 64-byte header), so with O_DIRECT the unaligned tail, under one
block, is read through the page cache and the aligned head is cut into parts.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

ALIGN = 4096  # bytes; the CPU pool's buffers start on this boundary too
PART_BYTES = 4 << 20  # bytes per read request at most
THREADS = 8  # read requests in flight at most, per reader
NO_DIRECT = "O_DIRECT refused"  # the problem a read reports when the file system refuses O_DIRECT
CLOSED = "disk tier closed"


WHOLE_FILE = 1 << 40  # part_bytes of a reader that reads each file in one request
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")  # no device behind their page cache


def file_system(path: str) -> str:
    """The type of the file system ``path`` lies on (that of the longest mount point above it in
    the mount table, the last one mounted there), e.g. ``ext4``, ``tmpfs``; ``unknown`` where the
    mount table cannot be read."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) > 2 and (real == fields[1] or real.startswith(fields[1].rstrip("/") + "/")) \
                        and len(fields[1]) >= len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        return "unknown"
    return kind


def memory_backed(path: str) -> bool:
    """Whether ``path`` lies on a file system held in memory (:data:`MEMORY_FILE_SYSTEMS`, by the
    mount table): its reads are copies, faster on several cores than on one."""
    return file_system(path) in MEMORY_FILE_SYSTEMS


def size_problem(path: str, nbytes: int) -> str | None:
    """Why the file at ``path`` cannot hold an ``nbytes`` chunk, or None if it can."""
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None if size == nbytes else f"{size} bytes on disk, {nbytes} expected"


class DirectRead:
    """One file's read, in flight on a :class:`DirectReader`. ``problem`` (None: every
    byte read) is final once ``done`` is set; :data:`NO_DIRECT` means read it another way. The
    caller keeps the buffer alive, and does not touch it, until then."""

    def __init__(self, on_done: Callable[[DirectRead], None] | None) -> None:
        self.problem: str | None = None
        self.done = threading.Event()
        self._on_done = on_done
        self._lock = threading.Lock()
        self._parts = 0
        self._fd = -1

    def wait(self, timeout: float | None = None) -> str | None:
        """The read's problem (None: read whole), once it has ended."""
        self.done.wait(timeout)
        return self.problem

    def _fail(self, problem: str) -> None:
        with self._lock:
            self.problem = self.problem or problem

    def _part_ended(self, future: Future) -> None:
        if future.cancelled():
            self._fail(CLOSED)
        elif future.exception() is not None:
            self._fail(repr(future.exception()))
        elif future.result() is not None:
            self._fail(future.result())
        with self._lock:
            self._parts -= 1
            if self._parts:
                return
        self._end()

    def _end(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.done.set()
        if self._on_done is not None:
            self._on_done(self)


class DirectReader:
    """A small fixed pool of ``threads`` threads reading chunk files in parallel parts, started on
    the first read; :meth:`close` ends it. Reads queue in the order they start. ``direct``: with
    O_DIRECT, else through the page cache (set to False once a file system refuses O_DIRECT: the
    disk tier then reads the same way, buffered)."""

    def __init__(self, threads: int = THREADS, part_bytes: int = PART_BYTES, direct: bool = True) -> None:
        if threads < 1 or part_bytes < ALIGN or part_bytes % ALIGN:
            raise ValueError(f"threads must be >= 1 and part_bytes a multiple of {ALIGN}, got {threads}, {part_bytes}")
        self.threads, self.part_bytes, self.direct = threads, part_bytes, direct
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def read(self, path: str, buf: memoryview) -> str | None:
        """Fill ``buf`` from the file at ``path``, which must be exactly ``len(buf)`` bytes; the
        problem (:data:`NO_DIRECT` if the file system refuses O_DIRECT), else None."""
        return self.start(path, buf).wait()

    def start(self, path: str, buf: memoryview, whole: bool = True,
              on_done: Callable[[DirectRead], None] | None = None) -> DirectRead:
        """Start reading the first ``len(buf)`` bytes of the file at ``path`` into ``buf``; the
        file must be exactly that long when ``whole``, else at least that long (then, with O_DIRECT,
        ``len(buf)`` must be a multiple of :data:`ALIGN`). ``on_done(read)`` runs once when it ends,
        on whichever thread ended it (a reader thread, or this one when it fails at once)."""
        read = DirectRead(on_done)
        direct = self.direct
        problem = self._open(read, path, buf, whole, direct)
        if problem is not None:
            read._fail(problem)
            read._end()
            return read
        head = len(buf) - len(buf) % ALIGN if direct else len(buf)
        spans = [(off, min(self.part_bytes, head - off)) for off in range(0, head, self.part_bytes)]
        if not spans:
            read._end()
            return read
        with self._lock:
            if self._closed:
                read._fail(CLOSED)
                read._end()
                return read
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvtier-disk-read")
            read._parts = len(spans)
            futures = [self._pool.submit(_read_part, read._fd, buf[off : off + n], off) for off, n in spans]
        for future in futures:
            future.add_done_callback(read._part_ended)
        return read

    def close(self) -> None:
        """Cancel queued parts (their reads end with :data:`CLOSED`), wait for those running and
        stop the threads; idempotent. Every read has ended when this returns."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _open(self, read: DirectRead, path: str, buf: memoryview, whole: bool, direct: bool) -> str | None:
        """Open ``path`` for ``read`` (its fd, O_DIRECT where ``direct``) and, with O_DIRECT, read the
        unaligned tail; the problem or None."""
        head = len(buf) - len(buf) % ALIGN if direct else len(buf)
        if direct and head and _address(buf) % ALIGN:
            return NO_DIRECT  # not a pool buffer: O_DIRECT would refuse it
        try:
            fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))
        except OSError as exc:
            return NO_DIRECT if exc.errno == errno.EINVAL else exc.strerror or type(exc).__name__
        read._fd = fd
        try:
            size = os.fstat(fd).st_size
            if size != len(buf) if whole else size < len(buf):
                return f"{size} bytes on disk, {len(buf)} expected"
            if head < len(buf):
                # The same file through the page cache (an unlink between the two opens fails the read).
                with open(path, "rb", buffering=0) as f:
                    if os.fstat(f.fileno()).st_ino != os.fstat(fd).st_ino:
                        return "file replaced while read"
                    if os.preadv(f.fileno(), [buf[head:]], head) != len(buf) - head:
                        return "file ended early"
        except OSError as exc:
            return exc.strerror or type(exc).__name__
        return None


def _read_part(fd: int, view: memoryview, offset: int) -> str | None:
    """Fill ``view`` from ``fd`` at ``offset`` (one request, re-issued on a short count)."""
    done = 0
    try:
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if not n:
                return "file ended early"
            done += n
    except OSError as exc:
        if exc.errno == errno.EINVAL and done == 0:
            return NO_DIRECT
        return exc.strerror or type(exc).__name__
    return None


def _address(buf: memoryview) -> int:
    """The address of ``buf``'s first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))
