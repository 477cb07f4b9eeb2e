"""What a prefill engine (P) has published for decode engines, pinned in its CPU tier.

P never lends engine blocks: a published request's chunks are saved like any other (copied out
of the engine's blocks inside the step, sealed and stored by the save executor), then pinned
here by a reference on the stored chunk, so that the CPU tier's LRU cannot evict them before
the decode engine (D) fetched them. A transfer's pins go when D releases it, when its
``hold_s`` expire, or, oldest first, when new pins would exceed ``max_bytes``; the last two
are counted. Thread-safe: the engine thread announces, the save thread pins, the chunk server
thread reads and releases.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from kvtier.storage import ChunkBuffer

logger = logging.getLogger(__name__)

Pin = Callable[[bytes], ChunkBuffer | None]  # storage key -> a reference on the stored chunk


@dataclass(slots=True)
class _Transfer:
    expected: set[bytes] = field(default_factory=set)  # storage keys announced for it
    pinned: dict[bytes, ChunkBuffer] = field(default_factory=dict)
    final: bool = False  # the request's last chunk was announced: nothing more will come
    active_s: float = 0.0  # clock of the last sign of life (a step that computed it)
    created_s: float = 0.0


@dataclass(slots=True)
class HoldStats:
    """Counters since start: transfers released by D, expired unfetched, and cut for room."""

    published: int = 0
    released: int = 0
    expired: int = 0
    overflowed: int = 0


class PublishHolds:
    """Pins of published transfers. ``pin`` takes a reference on a stored chunk (None if gone).

    ``max_bytes``: most bytes pinned at once. ``hold_s``: seconds a transfer stays pinned without
    being released. ``clock``: seconds, monotonic.
    """

    def __init__(self, pin: Pin, max_bytes: int, hold_s: float, clock: Callable[[], float] = time.monotonic):
        self._pin = pin
        self.max_bytes = max_bytes
        self.hold_s = hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._transfers: OrderedDict[str, _Transfer] = OrderedDict()  # oldest first
        self._by_key: dict[bytes, set[str]] = {}  # expected storage key -> transfers
        self._bytes = 0
        self.stats = HoldStats()
        # The chunk server looks at its waiting fetches only when a chunk may have become
        # servable, not on every poll (the engine's forward needs the GIL more than an idle
        # server does): at all of them once ``changed`` is set (a transfer's last chunk announced,
        # a withdrawal, a lease), else only at those for ``_stored`` keys (stored or given up
        # since it last looked).
        self.changed = threading.Event()
        self._stored: set[bytes] = set()

    def announce(self, transfer_id: str, keys: list[bytes], final: bool) -> None:
        """The engine computes ``transfer_id``; ``keys`` (storage keys) will be saved for it."""
        now = self._clock()
        with self._lock:
            t = self._transfers.get(transfer_id)
            if t is None:
                t = self._transfers[transfer_id] = _Transfer(created_s=now)
                self.stats.published += 1
            t.active_s = now
            t.final = t.final or final
            for key in keys:
                t.expected.add(key)
                self._by_key.setdefault(key, set()).add(transfer_id)
        if final:  # what the transfer lacks now never comes: its waiting fetches are answered missing
            self.changed.set()

    def stored(self, keys: list[bytes]) -> None:
        """``keys`` are now stored (saved, or found already stored): pin those announced."""
        with self._lock:
            self._stored.update(keys)
        for key in keys:
            with self._lock:
                wanted = [tid for tid in self._by_key.get(key, ()) if key not in self._transfers[tid].pinned]
            for tid in wanted:
                buffer = self._pin(key)
                if buffer is None:
                    continue
                with self._lock:
                    t = self._transfers.get(tid)
                    if t is None or key in t.pinned:
                        buffer.release()
                        continue
                    t.pinned[key] = buffer
                    self._bytes += buffer.data.numel()
                    cut = self._make_room_locked(keep=tid)
                self._release_all(cut)

    def state(self, transfer_id: str, key: bytes) -> str:
        """``pinned``, ``coming`` (announced or the transfer is still being computed), ``unknown``
        (never announced here) or ``ended`` (the transfer is complete and ``key`` is not in it)."""
        with self._lock:
            t = self._transfers.get(transfer_id)
            if t is None:
                return "unknown"
            if key in t.pinned:
                return "pinned"
            if key in t.expected or not t.final:
                return "coming"
            return "ended"

    def active(self, transfer_id: str, within_s: float) -> bool:
        """The transfer was being computed within the last ``within_s`` seconds (or is complete)."""
        with self._lock:
            t = self._transfers.get(transfer_id)
            return t is not None and (t.final or self._clock() - t.active_s <= within_s)

    def lost(self, keys: list[bytes]) -> None:
        """The saves of storage keys ``keys`` were given up (the save backlog was full, or the store
        failed): no transfer waits for them any more, so a consumer asking is answered ``missing``
        (and recomputes) instead of waiting out its timeout."""
        with self._lock:
            self._stored.update(keys)
            for key in keys:
                for transfer_id in self._by_key.pop(key, ()):
                    t = self._transfers.get(transfer_id)
                    if t is not None:
                        t.expected.discard(key)

    def take_stored(self) -> set[bytes]:
        """Storage keys stored or given up since the last call (the chunk server's waiting fetches
        for them may be answered now)."""
        with self._lock:
            keys, self._stored = self._stored, set()
        return keys

    def withdraw(self, transfer_id: str) -> None:
        """The request was aborted: nothing more will be published under ``transfer_id``."""
        with self._lock:
            t = self._transfers.get(transfer_id)
            if t is not None:
                t.final = True
                self._unexpect_locked(transfer_id, t.expected - set(t.pinned))
                t.expected = set(t.pinned)
        self.changed.set()

    def release(self, transfer_id: str) -> None:
        """D is done with the transfer."""
        with self._lock:
            t = self._pop_locked(transfer_id)
            if t is not None:
                self.stats.released += 1
        self._release_all([t] if t else [])

    def expire(self) -> None:
        """Drop transfers older than ``hold_s``."""
        now = self._clock()
        with self._lock:
            old = [tid for tid, t in self._transfers.items() if now - t.created_s > self.hold_s]
            gone = [self._pop_locked(tid) for tid in old]
            self.stats.expired += len(gone)
        if gone:
            logger.info("kvtier P/D: %d published transfers expired unfetched after %g s.", len(gone), self.hold_s)
        self._release_all(gone)

    def pinned_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def close(self) -> None:
        with self._lock:
            gone = [self._pop_locked(tid) for tid in list(self._transfers)]
        self._release_all(gone)

    # ---- internals (callers hold _lock) ------------------------------------------------------------
    def _make_room_locked(self, keep: str) -> list[_Transfer]:
        cut = []
        for tid in list(self._transfers):
            if self._bytes <= self.max_bytes:
                break
            if tid != keep:
                cut.append(self._pop_locked(tid))
        if cut:
            self.stats.overflowed += len(cut)
            logger.warning("kvtier P/D: pinned chunks exceed pd_hold_bytes=%d; unpinned the %d oldest transfers.",
                           self.max_bytes, len(cut))
        return cut

    def _pop_locked(self, transfer_id: str) -> _Transfer | None:
        t = self._transfers.pop(transfer_id, None)
        if t is None:
            return None
        self._unexpect_locked(transfer_id, t.expected)
        self._bytes -= sum(b.data.numel() for b in t.pinned.values())
        return t

    def _unexpect_locked(self, transfer_id: str, keys: set[bytes]) -> None:
        """``transfer_id`` no longer waits for ``keys``."""
        for key in keys:
            owners = self._by_key.get(key)
            if owners is not None:
                owners.discard(transfer_id)
                if not owners:
                    del self._by_key[key]

    @staticmethod
    def _release_all(transfers: list[_Transfer | None]) -> None:
        for t in transfers:
            if t is not None:
                for buffer in t.pinned.values():
                    buffer.release()
                t.pinned.clear()
