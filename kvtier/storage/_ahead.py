"""Read-ahead of a load's disk chunks: the chunks a load names in ``will_need`` are read in the
background, several at once, into CPU pool buffers that its ``get`` calls then take.

O_DIRECT reads bypass the page cache, so a ``POSIX_FADV_WILLNEED`` hint has nothing to fill; and
through the page cache (or from a tmpfs) one thread's copy runs at one core's speed. A load
reading its chunks one ``get`` at a time would keep one chunk's requests in flight, on one core.
Here :meth:`ReadAhead.want` starts the reads, in the load's order, and :meth:`ReadAhead.claim`
hands a read's buffer to the ``get`` of its key (waiting while the read is in flight).

Bounds: at most :data:`MAX_CHUNKS` chunks and ``max_bytes`` bytes are held at once, counting reads
in flight and chunks read but not yet claimed; the rest of a load's keys start as claims free
room. A chunk nobody claims within :data:`STALE_S` seconds (its load stopped early) is released,
and so is one whose disk copy is removed. Buffers come from the CPU pool without waiting
(``alloc``); when the pool has no room, read-ahead stops and the ``get`` calls read for themselves.

Ownership: a held buffer's reference is the read-ahead's until :meth:`claim` passes it to the
caller; it is released (``ref_count_down``) only once no read writes into it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ._direct import CLOSED, NO_DIRECT, DirectRead, DirectReader, size_problem

MAX_CHUNKS = 8  # chunks held at once (reads in flight plus chunks read and not yet claimed)
STALE_S = 10.0  # seconds a read chunk waits for its get before it is released


@dataclass(eq=False, slots=True)
class _Held:
    """One chunk read ahead: ``obj`` (a CPU pool MemoryObj, ours) filled from ``meta``'s file."""

    ek: Any
    meta: Any
    obj: Any
    nbytes: int
    landed: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    landed_at: float = 0.0


class ReadAhead:
    """The chunks read ahead for one disk tier. ``disk``: its LocalDiskBackend (``disk_lock``,
    ``dict``); ``alloc(nbytes)``: a CPU pool MemoryObj or None, never waiting; ``on_bad(ek, meta,
    problem)``: a chunk's file failed its read (drop it, say so once)."""

    def __init__(self, reader: DirectReader, disk: Any, alloc: Callable[[int], Any],
                 on_bad: Callable[[Any, Any, str], None], max_bytes: int) -> None:
        self._reader, self._disk, self._alloc, self._on_bad = reader, disk, alloc, on_bad
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: dict[Any, _Held] = {}
        self._queue: deque[Any] = deque()  # keys of the latest load still to start, in order
        self._starting = threading.Lock()  # one thread starts reads at a time, so room is counted once
        self._closed = False
        self.refused = False  # the file system refused O_DIRECT: no more read-ahead until the reader is buffered

    def want(self, eks: list[Any]) -> None:
        """Read ``eks`` (disk-only keys, in the order the load reads them) ahead, as room allows.
        They replace the keys an earlier load left unstarted; started reads stay."""
        with self._lock:
            self._queue = deque(ek for ek in dict.fromkeys(eks) if ek not in self._held)
        self._expire()
        self._start_more()

    def claim(self, ek: Any) -> Any:
        """The chunk read ahead for ``ek`` (a MemoryObj, +1 reference, now the caller's), waiting
        for its read if in flight; None if none was read ahead, its read failed or its disk copy
        is gone (the caller then reads for itself)."""
        with self._lock:
            held = self._held.get(ek)
        if held is None:
            return None
        held.landed.wait()
        with self._lock:
            mine = self._held.get(ek) is held and held.ok
            if mine:
                del self._held[ek]
        if not mine:
            return None  # a failed read released its buffer; a discarded one too
        disk = self._disk
        with disk.disk_lock:
            current = disk.dict.get(ek) is held.meta
            if current:
                disk.cache_policy.update_on_hit(ek, disk.dict)
        self._start_more()
        if not current:  # evicted or replaced since it was read: what we hold is no longer the tier's
            held.obj.ref_count_down()
            return None
        return held.obj

    def discard(self, ek: Any) -> None:
        """Forget ``ek``'s chunk (its disk copy is gone); a read in flight releases it on landing."""
        with self._lock:
            held = self._held.pop(ek, None)
            release = held is not None and held.landed.is_set()
        if release:
            held.obj.ref_count_down()

    def held_bytes(self) -> int:
        """Bytes of CPU pool buffers held now (reads in flight and chunks not yet claimed)."""
        with self._lock:
            return sum(h.nbytes for h in self._held.values())

    def close(self) -> None:
        """Stop starting reads and release every held buffer; the reader must be closed after,
        which ends (and so releases) the reads still in flight. Idempotent."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            held, self._held = list(self._held.values()), {}
            landed = [h for h in held if h.landed.is_set()]
        for h in landed:
            h.obj.ref_count_down()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [h for h in self._held.values() if h.landed.is_set() and now - h.landed_at > STALE_S]
            for h in stale:
                del self._held[h.ek]
        for h in stale:
            h.obj.ref_count_down()

    def _start_more(self) -> None:
        with self._starting:
            while True:
                with self._lock:
                    if self._closed or self.refused or not self._queue or len(self._held) >= MAX_CHUNKS:
                        return
                    ek = self._queue.popleft()
                    room = self.max_bytes - sum(h.nbytes for h in self._held.values())
                    if ek in self._held:
                        continue
                if not self._start(ek, room):
                    with self._lock:
                        self._queue.clear()  # no room now; the gets read for themselves
                    return

    def _start(self, ek: Any, room: int) -> bool:
        """Start reading ``ek``; False when there is no room for it."""
        disk = self._disk
        with disk.disk_lock:
            meta = disk.dict.get(ek)
            if meta is None:
                return True  # gone meanwhile: nothing to read
            nbytes = int(meta.shape.numel())
            if nbytes > room:
                return False
            meta.pin()  # LMCache's disk eviction skips pinned entries (it deletes their files)
        problem = size_problem(meta.path, nbytes)
        obj = None if problem is not None else self._alloc(nbytes)
        if obj is None:
            with disk.disk_lock:
                meta.unpin()
            if problem is not None:
                self._on_bad(ek, meta, problem)
            return problem is not None
        held = _Held(ek, meta, obj, nbytes)
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._held[ek] = held
        if closed:
            with disk.disk_lock:
                meta.unpin()
            obj.ref_count_down()
            return False
        self._reader.start(meta.path, obj.byte_array, on_done=lambda read: self._landed(held, read))
        return True

    def _landed(self, held: _Held, read: DirectRead) -> None:
        """A read ended (on a reader thread, or the starting one): keep its chunk for the claim,
        or release it (failed, discarded, or the store closing)."""
        with self._disk.disk_lock:
            held.meta.unpin()
        problem = read.problem
        with self._lock:
            mine = self._held.get(held.ek) is held
            held.ok = mine and problem is None
            if mine and not held.ok:
                del self._held[held.ek]
            if problem == NO_DIRECT:
                self.refused = True
            held.landed_at = time.monotonic()
            if held.ok:
                held.landed.set()
        if held.ok:
            return
        held.obj.ref_count_down()
        if mine and problem not in (NO_DIRECT, CLOSED):
            self._on_bad(held.ek, held.meta, problem)  # before a waiting claim wakes: it finds the chunk gone
        held.landed.set()
