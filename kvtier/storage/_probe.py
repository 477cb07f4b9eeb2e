"""How fast the disk tier reads, measured once when a worker starts, before any load.

A short read, at most :data:`MAX_BYTES` bytes or :data:`MAX_S` seconds (whichever ends first),
through the path a load's disk reads take (:class:`~kvtier.storage._disk.DiskTier`): buffered
reads after a ``POSIX_FADV_WILLNEED`` hint on the files, as :meth:`DiskTier.will_need` gives a
load, or O_DIRECT reads of each file's block-aligned head (``disk_io="direct"``; buffered when
the file system refuses O_DIRECT, as loads fall back too).

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

import errno
import logging
import mmap
import os
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_BYTES = 64 << 20  # bytes read at most
MAX_S = 0.3  # seconds of reading at most (the hint and the reads; not the scratch file's write)
SCRATCH_BYTES = 16 << 20  # bytes of the scratch file an empty directory gets
_READ_BYTES = 4 << 20  # bytes per read call
_ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses are multiples of this


@dataclass(frozen=True, slots=True)
class DiskSpeed:
    """``nbytes`` bytes read from ``files`` files in ``seconds`` (wall clock). ``source``:
    ``"chunks"`` (the tier's own files) or ``"scratch"``; ``direct``: read with O_DIRECT."""

    nbytes: int
    seconds: float
    files: int
    source: str
    direct: bool

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds

    def describe(self) -> str:
        """E.g. ``1.52 GB/s (64 MiB of 2 chunk files, O_DIRECT, 42 ms)``."""
        what = "chunk files" if self.source == "chunks" else "scratch file"
        return (f"{self.bytes_per_s / 1e9:.2f} GB/s ({self.nbytes / (1 << 20):.0f} MiB of {self.files} {what}, "
                f"{'O_DIRECT' if self.direct else 'buffered'}, {self.seconds * 1e3:.0f} ms)")


def measure_read_speed(directory: str, paths: list[str], o_direct: bool, max_bytes: int = MAX_BYTES,
                       max_s: float = MAX_S) -> DiskSpeed | None:
    """Read ``paths`` (chunk files, in the order given; a scratch file in ``directory`` when
    empty) for at most ``max_bytes`` bytes or ``max_s`` seconds. None when nothing could be read
    (the reason is logged at debug level): the tier's speed is then learnt from loads."""
    scratch = None
    if not paths:
        scratch = _write_scratch(directory, min(SCRATCH_BYTES, max_bytes))
        if scratch is None:
            return None
        paths = [scratch]
    try:
        return _timed_reads(paths, o_direct, max_bytes, max_s, "scratch" if scratch else "chunks")
    finally:
        if scratch is not None:
            unlink_quietly(scratch)


def _timed_reads(paths: list[str], o_direct: bool, max_bytes: int, max_s: float, source: str) -> DiskSpeed | None:
    buf = mmap.mmap(-1, _READ_BYTES)  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    direct = o_direct and hasattr(os, "O_DIRECT")
    total = files = 0
    try:
        start = time.perf_counter()
        if not direct:
            will_need(paths)
        for path in paths:
            if total >= max_bytes or time.perf_counter() - start >= max_s:
                break
            n, direct = _read_file(path, view, direct, max_bytes - total, start + max_s)
            total, files = total + n, files + (n > 0)
        seconds = time.perf_counter() - start
    finally:
        view.release()
        buf.close()
    if total == 0 or seconds <= 0:
        logger.debug("kvtier: disk read speed not measured: nothing read from %d files", len(paths))
        return None
    return DiskSpeed(total, seconds, files, source, direct)


def _read_file(path: str, view: memoryview, direct: bool, budget: int, deadline: float) -> tuple[int, bool]:
    """Bytes read from ``path`` (at most ``budget``, stopping at ``deadline``), and whether the
    read was direct (False after the file system refused O_DIRECT)."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            return _read_file(path, view, False, budget, deadline)
        logger.debug("kvtier: disk speed probe skipped %s: %s", path, exc)
        return 0, direct
    done = 0
    try:
        size = os.fstat(fd).st_size
        end = min(size - size % _ALIGN if direct else size, budget - budget % _ALIGN if direct else budget)
        while done < end and time.perf_counter() < deadline:
            n = os.readv(fd, [view[: min(len(view), end - done)]])
            if not n:
                break
            done += n
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL and done == 0:
            os.close(fd)
            return _read_file(path, view, False, budget, deadline)
        logger.debug("kvtier: disk speed probe stopped reading %s: %s", path, exc)
    os.close(fd)
    return done, direct


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
