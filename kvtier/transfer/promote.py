"""Promotion while a prompt waits: disk chunks a plan left to recompute are read into the CPU tier
in the background, so the prompt's next sight is a CPU hit.

Lowest priority of the rank's work: threads nicer than the save thread, that read a chunk only
while no load runs and no save is pending (``busy``). Behind a slow disk one chunk is read at a
time. On a medium with bandwidth to spare (:func:`beside_loads`: a tmpfs, or a disk the probe
measured at :data:`FAST_BYTES_PER_S` or more) it reads beside loads too, on the disk tier's second
reader, :data:`FAST_READERS` chunks at a time: behind such a disk the loads of a burst of prompts
run back to back, and a promoter that waited for them, or read one chunk at a time (each chunk's
allocate, read and promote in turn), did not run ahead of the queue (eight 32k prompts on a tmpfs,
an H200 host: 75,264 of the last four's 131,072 tokens in the CPU tier by their turns).

The latest submission goes first, its keys in order: a step's keys are those of prompts further
back in the queue than the last step's, which have longer to wait, so they are the ones a
promotion can still reach before their turn (behind a slow disk, a burst of prompts would
otherwise be promoted in the order they are recomputed, each too late). A read is the store's
own: :meth:`ChunkStore.get` (``background``) promotes a disk chunk into CPU (and reports it), and
the buffer is released at once. Bounded: at most ``max_bytes`` of chunks queued or being read;
keys beyond that are dropped and counted (a later sight of the prompt asks again).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Callable, Iterable

from kvtier.storage import ChunkStore, DiskSpeed, Tier

logger = logging.getLogger(__name__)

PROMOTE_NICE = 15  # nicer than the save thread (+10): promotions yield to saves under CPU contention
_YIELD_S = 0.002  # seconds between looks while loads or saves run
FAST_BYTES_PER_S = 8e9  # a disk tier at least this fast (NVMe RAID) has room for promotions beside loads
FAST_READERS = 4  # chunks read at once on such a medium (each in parts on the second reader's threads)


def beside_loads(speed: DiskSpeed | None) -> bool:
    """Whether promotions may read while loads run, given the disk tier's measured ``speed``: on a
    file system in memory its reads are copies that scale with cores, and a disk of
    :data:`FAST_BYTES_PER_S` or more serves both; a slower disk is the loads' alone."""
    return speed is not None and (speed.memory or speed.bytes_per_s >= FAST_BYTES_PER_S)


class Promoter:
    """Reads queued storage keys from disk into the CPU tier of ``store``, on its own threads.

    ``chunk_bytes``: bytes of one stored chunk (the bound counts whole chunks). ``max_bytes``:
    most bytes queued or in flight. ``busy``: whether loads run or saves are pending now (any
    thread); promotions wait for it to be False. ``readers``: chunks read at once (threads).
    """

    def __init__(self, store: ChunkStore, chunk_bytes: int, max_bytes: int, busy: Callable[[], bool],
                 readers: int = 1):
        if readers < 1:
            raise ValueError(f"readers must be >= 1, got {readers}")
        self.store, self.busy = store, busy
        self.max_chunks = max(1, max_bytes // max(1, chunk_bytes))
        self.promoted = self.dropped = 0  # chunks read into CPU; keys dropped or displaced (queue full)
        self._queue: deque[deque[bytes]] = deque()  # submissions, the latest last; each its keys in order
        self._queued: set[bytes] = set()
        self._reading = 0  # chunks taken from the queue and not yet read
        self._cond = threading.Condition()
        self._closing = False
        self._threads = [threading.Thread(target=self._loop, name=f"kvtier-promote-{i}", daemon=True)
                         for i in range(readers)]
        for thread in self._threads:
            thread.start()

    def submit(self, keys: Iterable[bytes]) -> int:
        """Queue storage ``keys`` for promotion (those queued already are skipped); returns how many
        were queued. Never waits. Any thread."""
        batch: deque[bytes] = deque()
        with self._cond:
            for key in keys:
                if key in self._queued:
                    continue
                if len(self._queued) + self._reading >= self.max_chunks and not self._drop_oldest():
                    self.dropped += 1
                    continue
                batch.append(key)
                self._queued.add(key)
            if batch:
                self._queue.append(batch)
                self._cond.notify(len(batch))  # as many readers as it has keys
        return len(batch)

    def _drop_oldest(self) -> bool:
        """Make room for one key of a newer submission: drop the last key of the oldest one (the
        first of a chain are worth the most: a chunk is reached through those before it). False
        when nothing is queued (all taken by reads). Under the lock."""
        if not self._queue:
            return False
        oldest = self._queue[0]
        self._queued.discard(oldest.pop())
        self.dropped += 1
        if not oldest:
            self._queue.popleft()
        return True

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Wait until nothing is queued or being read (False after ``timeout_s`` seconds)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._reading, timeout_s)

    def close(self) -> None:
        """Stop the threads; queued keys are dropped, reads under way finish."""
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._queued.clear()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def _loop(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PROMOTE_NICE)  # this thread only
        except (AttributeError, OSError):
            pass
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if self._closing:
                    return
                key = self._queue[-1].popleft()  # the latest submission first
                if not self._queue[-1]:
                    self._queue.pop()
                self._queued.discard(key)
                self._reading += 1
            try:
                while self.busy() and not self._closing:
                    time.sleep(_YIELD_S)  # loads and saves first
                self._promote(key)
            finally:
                with self._cond:
                    self._reading -= 1
                    self._cond.notify_all()

    def _promote(self, key: bytes) -> None:
        try:
            if self._closing or self.store.contains(key) is not Tier.DISK:
                return  # evicted, removed, or promoted by a load meanwhile
            buf = self.store.get(key, background=True)  # a disk read promotes into CPU
            if buf is not None:
                buf.release()
                self.promoted += 1
        except Exception as exc:  # a store closing under us, a vanished file: the prompt recomputes anyway
            logger.debug("kvtier: promoting chunk %s failed: %s", key.hex()[:16], exc)
