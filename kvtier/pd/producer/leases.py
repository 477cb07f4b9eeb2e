"""A prefill engine's (P) engine blocks, kept after a P/D request ends so that decode engines
(D) READ them HBM to HBM.

While a published request runs, its blocks are its own: each step's save tells which blocks
hold which computed chunk (:meth:`BlockLeases.live`), so a decode engine that named its own
blocks first (push) is written into straight from them. When a published request finishes,
vLLM keeps its blocks (the connector's ``request_finished`` asked it to delay the free) and the
scheduler half hands them here: a *lease* of ``lease_s``, unless the D being written into has
released the transfer already (the blocks go at once then). While it runs, the chunk server
answers D's fetches with P's block ids instead of a CPU-tier buffer, and D READs the blocks
straight into its own (or P goes on writing into D's). The lease ends, and vLLM frees the
blocks (the worker reports the request in ``finished_sending``):

- when D releases the transfer (its READs are done, or P's WRITEs);
- when ``lease_s`` pass and no D was given the blocks: D then gets the same chunks from P's CPU
  tier (the path every transfer takes without a lease);
- when ``lease_s`` plus ``grace_s`` pass although a D was given them but never released: it died
  or stalled. A READ that still lands after the free reads reused blocks; D's checksum of the
  blocks it received catches that and recomputes.

A running request that is aborted or preempted gives its blocks back to vLLM at once: from the
step that learns of it on (before that step's kernels), none of them is handed to a D
(:meth:`BlockLeases.stopped`).

Thread-safe: the engine thread lends and takes what ended, the chunk server thread hands out
blocks and releases.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Lease:
    req_id: str
    block_ids: tuple[int, ...]  # the request's blocks, in token order
    chunks: dict[bytes, int]  # chain key of each of its chunks -> the chunk's first block
    ends_s: float  # clock at which an untouched lease ends
    lent: bool = False  # some D was given block ids: wait for its release (or the grace)


@dataclass(slots=True)
class _Live:
    """A published request still running: the blocks of each chunk computed so far."""

    req_id: str
    chunks: dict[bytes, tuple[int, ...]]  # chain key -> the chunk's blocks
    lent: bool = False  # some D was given block ids
    released: bool = False  # ... and released the transfer: no lease needed when the request ends


@dataclass(slots=True)
class LeaseStats:
    """Counters since start: leases begun, released by D, ended unread, ended unreleased."""

    lent: int = 0
    released: int = 0
    expired: int = 0
    abandoned: int = 0


class BlockLeases:
    """Leases by transfer id. ``chunk_blocks``: blocks per chunk; ``block_bytes``: engine bytes
    per block (all regions), for :attr:`held_bytes`; ``grace_s``: see the module docstring.
    ``clock``: seconds, monotonic."""

    def __init__(self, chunk_blocks: int, block_bytes: int, grace_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.chunk_blocks = chunk_blocks
        self.block_bytes = block_bytes
        self.grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)  # a D released a lease
        self._leases: dict[str, _Lease] = {}
        self._ended: set[str] = set()  # request ids whose blocks vLLM may free now
        self._expected: dict[str, str] = {}  # transfer id -> request id: computed, its lease not begun yet
        self._live: dict[str, _Live] = {}  # transfer id -> its running request's computed chunks
        self.stats = LeaseStats()

    def expect(self, transfer_id: str, req_id: str) -> None:
        """The request's last chunk is computed: a lease should follow once it finishes (a
        fetch for it may wait a moment for the lease rather than take the CPU tier's copy)."""
        with self._lock:
            self._expected[transfer_id] = req_id

    def expected(self, transfer_id: str) -> bool:
        """A lease is expected for ``transfer_id`` and has not begun."""
        with self._lock:
            return transfer_id in self._expected

    def live(self, transfer_id: str, req_id: str, block_ids: tuple[int, ...], keys: tuple[bytes, ...]) -> None:
        """The running request ``req_id`` computed the chunks ``keys`` into ``block_ids`` (in
        order, :attr:`chunk_blocks` each; the last may hold fewer: a partial tail)."""
        with self._lock:
            live = self._live.get(transfer_id)
            if live is None or live.req_id != req_id:
                live = self._live[transfer_id] = _Live(req_id, {})
            for i, key in enumerate(keys):
                chunk = tuple(block_ids[i * self.chunk_blocks:(i + 1) * self.chunk_blocks])
                if chunk:
                    live.chunks[key] = chunk

    def finished(self, req_ids: set[str]) -> None:
        """These requests finished: those not lent by now never will be."""
        with self._lock:
            for transfer_id in [t for t, r in self._expected.items() if r in req_ids]:
                del self._expected[transfer_id]
            for transfer_id in [t for t, live in self._live.items() if live.req_id in req_ids]:
                del self._live[transfer_id]

    def stopped(self, transfer_ids: tuple[str, ...]) -> None:
        """These transfers' running requests were aborted or preempted: vLLM has their blocks back,
        so no decode engine is given them from now on (a READ or WRITE already posted from them
        lands what the blocks hold then, which fails the decode engine's KVSUM64 check)."""
        with self._lock:
            for transfer_id in transfer_ids:
                self._live.pop(transfer_id, None)
                self._expected.pop(transfer_id, None)

    def lend(self, transfer_id: str, req_id: str, block_ids: tuple[int, ...], keys: tuple[bytes, ...],
             lease_s: float) -> None:
        """Keep ``req_id``'s ``block_ids`` for ``lease_s`` under ``transfer_id``; ``keys``: the
        chain keys of its chunks, in order (chunk i starts at block i × ``chunk_blocks``). A
        second lease under the same transfer id ends the first (its request's blocks are freed)."""
        with self._lock:
            self._expected.pop(transfer_id, None)
            live = self._live.pop(transfer_id, None)
            old = self._leases.pop(transfer_id, None)
            if old is not None:
                self._ended.add(old.req_id)
            chunks = {key: i * self.chunk_blocks for i, key in enumerate(keys)}
            if live is not None and live.released and live.req_id == req_id:  # its D already has it all
                self._ended.add(req_id)
                self.stats.released += 1
                return
            lent = live is not None and live.lent and live.req_id == req_id  # a D reads or is written into
            self._leases[transfer_id] = _Lease(req_id, tuple(block_ids), chunks, self._clock() + lease_s, lent)
            self.stats.lent += 1
        logger.debug("kvtier P/D: lease of transfer %s began: %d blocks for %.0f ms", transfer_id, len(block_ids),
                     lease_s * 1000)

    def holds(self, transfer_id: str) -> bool:
        """Whether ``transfer_id``'s blocks are under a lease now (a pull may ask for them all at once)."""
        with self._lock:
            lease = self._leases.get(transfer_id)
            return lease is not None and self._clock() < lease.ends_s

    def end_now(self, req_id: str) -> None:
        """The request's blocks are not to be kept at all (no way to lend them here)."""
        with self._lock:
            self._ended.add(req_id)

    def blocks(self, transfer_id: str, key: bytes, count: int) -> tuple[int, ...] | None:
        """The ``count`` blocks of the transfer's chunk ``key`` (a chain key), now handed to a D
        (which must release the transfer): the running request's (for a WRITE posted, or a READ
        asked, while the request still owns them), else its lease's; None when neither holds
        the chunk whole."""
        with self._lock:
            running = self._live.get(transfer_id)
            if running is not None and len(running.chunks.get(key, ())) == count > 0:
                running.lent = True
                return running.chunks[key]
            lease = self._leases.get(transfer_id)
            first = None if lease is None else lease.chunks.get(key)
            if first is None or self._clock() >= lease.ends_s or count <= 0 or first + count > len(lease.block_ids):
                return None
            lease.lent = True
            return lease.block_ids[first:first + count]

    def release(self, transfer_id: str) -> None:
        """D is done reading (or gave up): the blocks may be freed."""
        with self._lock:
            lease = self._leases.pop(transfer_id, None)
            if lease is not None:
                self._ended.add(lease.req_id)
                self.stats.released += 1
                self._released.notify_all()
            live = self._live.get(transfer_id)
            if live is not None:
                live.released = True  # D has what it wanted: the request's blocks go when it ends
        if lease is not None:
            logger.debug("kvtier P/D: lease of transfer %s ended: released by the decode engine", transfer_id)

    def expire(self) -> None:
        """End the leases whose time is up (see the module docstring)."""
        now = self._clock()
        ended = []
        with self._lock:
            for transfer_id, lease in list(self._leases.items()):
                if now >= lease.ends_s + (self.grace_s if lease.lent else 0.0):
                    del self._leases[transfer_id]
                    self._ended.add(lease.req_id)
                    ended.append((transfer_id, "never released by the decode engine it lent to" if lease.lent
                                  else "expired unread"))
                    if lease.lent:
                        self.stats.abandoned += 1
                    else:
                        self.stats.expired += 1
        for transfer_id, why in ended:
            logger.debug("kvtier P/D: lease of transfer %s ended: %s", transfer_id, why)

    def wait_ended(self, timeout_s: float) -> None:
        """With leases running and none ended, wait up to ``timeout_s`` for a D to release one
        (engine thread, in a step that computes nothing: vLLM steps on while blocks are held)."""
        with self._lock:
            if self._leases and not self._ended and timeout_s > 0:
                self._released.wait(timeout_s)

    def take_ended(self) -> set[str]:
        """Request ids whose blocks vLLM may free now (each once)."""
        self.expire()
        with self._lock:
            ended, self._ended = self._ended, set()
        return ended

    def end_all(self) -> set[str]:
        """End every lease (the engine shuts down); the request ids."""
        with self._lock:
            for lease in self._leases.values():
                self._ended.add(lease.req_id)
            self._leases.clear()
            self._live.clear()
            ended, self._ended = self._ended, set()
        return ended

    @property
    def held_bytes(self) -> int:
        """Engine bytes kept under running leases."""
        with self._lock:
            return sum(len(lease.block_ids) for lease in self._leases.values()) * self.block_bytes
