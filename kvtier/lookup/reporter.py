"""Worker side of the commit protocol: tell rank 0 what this rank holds, in the background.

Whoever changes what a rank holds (a save that landed, an eviction, a removal, a promotion from
disk) calls :meth:`HoldReporter.changed` with the storage keys; that only appends to a queue, so
it is safe on any thread, under any lock, on the hot path. One thread per rank drains the queue,
asks the store where each key is *now*, and sends one :class:`HoldReport` per batch. Re-reading
the tier at send time, on one thread in queue order, means a report can never undo a later
change: the last report about a key describes its state after its last change.

A reporter in the lookup server's own process (rank 0) hands its reports to the server directly:
once :meth:`flush` returns they are applied, and that process's lookups (direct too) see them.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Iterable

import msgspec
import zmq

from kvtier.lookup.protocol import MAX_KEYS, VERSION, HoldReport, LookupReply, PeerAddress, decode_reply, encode
from kvtier.lookup.server import in_process

logger = logging.getLogger(__name__)

TierOf = Callable[[bytes], str | None]  # storage key -> "cpu" / "disk" / None (not held)
_STOP = object()


class HoldReporter:
    """Reports rank ``rank``'s holdings to the lookup server at ``endpoint``.

    ``fingerprint``: this rank's layout fingerprint (16 bytes). ``tier_of``: where this rank holds
    a storage key now, called on the reporter's thread only. ``base``, ``heads``: see
    :class:`HoldReport` (empty: chunks per TP rank).
    """

    def __init__(self, endpoint: str, rank: int, world_size: int, fingerprint: bytes, tier_of: TierOf,
                 base: bytes = b"", heads: tuple[int, int, int] | tuple[()] = ()):
        self.endpoint = endpoint
        self.rank = rank
        self.world_size = world_size
        self.fingerprint = fingerprint
        self.base, self.heads = base, list(heads)
        self._tier_of = tier_of
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._warned = False
        self.sent_reports = self.dropped_reports = 0
        self._thread = threading.Thread(target=self._run, name=f"kvtier-report-{rank}", daemon=True)
        self._thread.start()

    def changed(self, keys: Iterable[bytes]) -> None:
        """What this rank holds under ``keys`` changed; report it soon. Never blocks."""
        for key in keys:
            self._queue.put(key)

    def reaffirm(self, keys: Iterable[bytes]) -> None:
        """``keys`` are still held, unchanged: reported again only if a report of this rank was
        ever dropped (then they may be what rank 0 misses). Never blocks."""
        if self.dropped_reports:
            self.changed(keys)

    def advertise(self, endpoint: str) -> None:
        """Tell rank 0 where this rank's P/D chunk server listens. Never blocks."""
        self._queue.put(PeerAddress(VERSION, self.rank, self.world_size, endpoint))

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every change queued before this call has been sent; False on timeout."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        """Send what is queued, then stop (idempotent). Call before the store closes."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=10)

    # ---- the reporter thread -----------------------------------------------------------------
    def _run(self) -> None:
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 2000)  # a last report at shutdown still goes out
        socket.connect(self.endpoint)  # queues reports until rank 0's server is up
        try:
            self._send(socket, [])  # rank 0 learns this rank's fingerprint, so its storage keys
            stop = False
            while not stop:
                batch = [self._queue.get()]
                while len(batch) < MAX_KEYS:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                keys = list(dict.fromkeys(k for k in batch if isinstance(k, bytes)))
                if keys:
                    self._send(socket, keys)
                for item in batch:
                    if isinstance(item, PeerAddress):
                        self._deliver(socket, item, flags=0)
                    if isinstance(item, threading.Event):
                        item.set()
                    stop = stop or item is _STOP
                self._read_errors(socket)
        except Exception:
            logger.exception("kvtier: rank %d stopped reporting its chunks; lookups will miss them", self.rank)
        finally:
            socket.close()

    def _send(self, socket: zmq.Socket, keys: list[bytes]) -> None:
        tiers = []
        for key in keys:
            try:
                tiers.append(self._tier_of(key) or "")
            except Exception:  # noqa: BLE001 - e.g. the store closed under us: report it lost
                tiers.append("")
        report = HoldReport(VERSION, self.rank, self.world_size, self.fingerprint, keys, tiers, self.base, self.heads)
        try:
            self._deliver(socket, report)
            self.sent_reports += 1
        except zmq.Again:
            # Rank 0 is gone or far behind. A lost "held" only hides a chunk (until reaffirmed);
            # a lost "gone" at worst promises a chunk whose load then fails and is recomputed.
            self.dropped_reports += 1
            if not self._warned:
                logger.warning("kvtier: rank %d could not report %d chunks to %s (queue full); dropped.",
                               self.rank, len(keys), self.endpoint)
                self._warned = True

    def _deliver(self, socket: zmq.Socket, message: HoldReport | PeerAddress, flags: int = zmq.NOBLOCK) -> None:
        """To a server in this process directly (applied on return), else over the socket."""
        server = in_process(self.endpoint)
        if server is None:
            socket.send_multipart([b"", encode(message)], flags=flags)
        elif (reply := server.answer(message)) is not None:
            self._refused(reply)

    def _refused(self, reply: LookupReply) -> None:
        logger.warning("kvtier: rank %d's chunk report was refused: %s", self.rank, reply.error)

    def _read_errors(self, socket: zmq.Socket) -> None:
        """The server answers a report only to refuse it: log why."""
        while socket.poll(0, zmq.POLLIN):
            try:
                self._refused(decode_reply(socket.recv_multipart()[-1]))
            except (msgspec.DecodeError, ValueError):  # UnicodeDecodeError too
                pass
