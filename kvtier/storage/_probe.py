"""How fast the disk tier reads, measured once when a worker starts, before any load.

A short read, at most :data:`MAX_BYTES` bytes or :data:`MAX_S` seconds (whichever ends first),
on the tier's own :class:`~kvtier.storage._direct.DirectReader` (:class:`~kvtier.storage._disk.DiskTier`),
up to :data:`~kvtier.storage._ahead.MAX_CHUNKS` files at once: with O_DIRECT (``disk_io="direct"``)
each file's block-aligned head in parallel parts, as a load's read-ahead keeps them; through the
page cache as the tier reads (each file whole on a disk, in parallel parts on a tmpfs); buffered
when the file system refuses O_DIRECT, as loads fall back too. No ``POSIX_FADV_WILLNEED`` hint on
the tier's files: that would read the whole tier into the page cache at start.

What is read:

* the chunk files the tier already holds, least recently used first: after a restart these
  are what the first loads read. Buffered, a file still in the page cache reads at memory
  speed, as a load of it would;
* with no chunk files, a scratch file of :data:`SCRATCH_BYTES` written in the directory,
  flushed (``fsync``) and dropped from the page cache (``POSIX_FADV_DONTNEED``) before it is
  read, then deleted. That measures the device where the file system honours the hint; where
  it does not (tmpfs, some network file systems) it measures the page cache: too fast, which
  only means no load is vetoed on the probe's word.

The figure leaves out what a load adds to the read (verifying the chunk, copying it into engine
blocks), so it is a lower bound on a disk load's time: a veto it supports is sound.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import time
from collections import deque
from dataclasses import dataclass

from ._ahead import MAX_CHUNKS
from ._direct import ALIGN, NO_DIRECT, DirectRead, DirectReader, memory_backed

logger = logging.getLogger(__name__)

MAX_BYTES = 64 << 20  # bytes read at most
MAX_S = 0.3  # seconds of reading at most (not counting the scratch file's write)
SCRATCH_BYTES = 16 << 20  # bytes of the scratch file an empty directory gets


@dataclass(frozen=True, slots=True)
class DiskSpeed:
    """``nbytes`` bytes read from ``files`` files in ``seconds`` (wall clock). ``source``:
    ``"chunks"`` (the tier's own files) or ``"scratch"``; ``direct``: read with O_DIRECT;
    ``memory``: the files lie on a file system held in memory (tmpfs), whose reads are copies
    that scale with cores (the probe's few files understate it)."""

    nbytes: int
    seconds: float
    files: int
    source: str
    direct: bool
    memory: bool = False

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds

    def describe(self) -> str:
        """E.g. ``1.52 GB/s (64 MiB of 2 chunk files, O_DIRECT, 42 ms)``."""
        what = "chunk files" if self.source == "chunks" else "scratch file"
        return (f"{self.bytes_per_s / 1e9:.2f} GB/s ({self.nbytes / (1 << 20):.0f} MiB of {self.files} {what}, "
                f"{'O_DIRECT' if self.direct else 'buffered'}{', in memory' if self.memory else ''}, "
                f"{self.seconds * 1e3:.0f} ms)")


def measure_read_speed(directory: str, paths: list[str], o_direct: bool, max_bytes: int = MAX_BYTES,
                       max_s: float = MAX_S, reader: DirectReader | None = None) -> DiskSpeed | None:
    """Read ``paths`` (chunk files, in the order given; a scratch file in ``directory`` when
    empty) for at most ``max_bytes`` bytes or ``max_s`` seconds. None when nothing could be read
    (the reason is logged at debug level): the tier's speed is then learnt from loads.
    ``reader``: the disk tier's O_DIRECT reader (a reader of its own, closed after, if None)."""
    scratch = None
    if not paths:
        scratch = _write_scratch(directory, min(SCRATCH_BYTES, max_bytes))
        if scratch is None:
            return None
        paths = [scratch]
    try:
        source = "scratch" if scratch else "chunks"
        direct = o_direct and hasattr(os, "O_DIRECT")
        if reader is not None and reader.direct != direct:
            reader = None  # the tier's reader reads another way: the probe opens its own
        speed = _parallel_reads(paths, max_bytes, max_s, source, reader, direct)
        if speed is NO_DIRECT:  # refused: loads read through the page cache, and so does this
            speed = _parallel_reads(paths, max_bytes, max_s, source, None, False)
        return dataclasses.replace(speed, memory=True) if speed is not None and memory_backed(directory) else speed
    finally:
        if scratch is not None:
            unlink_quietly(scratch)


def _parallel_reads(paths: list[str], max_bytes: int, max_s: float, source: str,
                    reader: DirectReader | None, direct: bool) -> DiskSpeed | str | None:
    """Each file's aligned head (within the budget) read whole on ``reader`` (one of its own,
    O_DIRECT where ``direct``, if None), :data:`MAX_CHUNKS` files in flight; :data:`NO_DIRECT` if
    the file system refuses O_DIRECT."""
    own = reader is None
    reader = reader or DirectReader(direct=direct)
    buf = mmap.mmap(-1, max(ALIGN, max_bytes - max_bytes % ALIGN))  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    flight: deque[tuple[int, DirectRead]] = deque()
    total = files = used = 0
    refused = False

    def land() -> None:
        nonlocal total, files, refused
        n, read = flight.popleft()
        problem = read.wait()
        if problem is None:
            total, files = total + n, files + 1
        elif problem == NO_DIRECT:
            refused = True
        else:
            logger.debug("kvtier: disk speed probe stopped reading a file: %s", problem)

    try:
        start = time.perf_counter()
        for path in paths:
            if refused or used >= len(view) or time.perf_counter() - start >= max_s:
                break
            try:
                size = os.stat(path).st_size
            except OSError as exc:
                logger.debug("kvtier: disk speed probe skipped %s: %s", path, exc)
                continue
            n = min(size - size % ALIGN, len(view) - used)
            if n <= 0:
                continue
            if len(flight) >= MAX_CHUNKS:
                land()
            flight.append((n, reader.start(path, view[used : used + n], whole=False)))
            used += n
        while flight:
            land()
        seconds = time.perf_counter() - start
    finally:
        while flight:  # only on an exception: no read may still write into the buffer
            flight.popleft()[1].wait()
        if own:
            reader.close()
    del view, buf  # unmapped once the reads' views of it are gone too
    if refused and total == 0:
        return NO_DIRECT
    if total == 0 or seconds <= 0:
        logger.debug("kvtier: disk read speed not measured: nothing read from %d files", len(paths))
        return None
    return DiskSpeed(total, seconds, files, source, reader.direct)


def will_need(paths: list[str]) -> None:
    """Ask the kernel to read ``paths`` into the page cache (``POSIX_FADV_WILLNEED``); errors ignored."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)


def _write_scratch(directory: str, nbytes: int) -> str | None:
    """A flushed file of ``nbytes`` bytes in ``directory``, dropped from the page cache; None
    (nothing left behind) if it cannot be written, e.g. on a full disk."""
    path = os.path.join(directory, f".kvtier-speed-{os.getpid()}")
    block = os.urandom(1 << 20)  # not zeros: a compressing file system would store nothing
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(max(1, nbytes // len(block))):
                os.write(fd, block)
            os.fsync(fd)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except (OSError, AttributeError):
                pass
        finally:
            os.close(fd)
    except OSError as exc:
        logger.debug("kvtier: disk read speed not measured: scratch file %s: %s", path, exc)
        unlink_quietly(path)
        return None
    return path


def unlink_quietly(path: str) -> None:
    """Remove ``path`` if it is there; any error is ignored (best effort)."""
    try:
        os.unlink(path)
    except OSError:
        pass
