"""Scheduler-side lookup client. A timeout or a refused request is a miss, never a hang.

Where rank 0's server runs in this same process (TP=1), the client asks it directly
(:meth:`~kvtier.lookup.server.LookupServer.answer`): no socket, no wait for the server's thread.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from kvtier.lookup.protocol import MAX_KEYS, MAX_MESSAGE_BYTES, VERSION, LookupReply, LookupRequest, decode_reply, encode
from kvtier.lookup.server import in_process

logger = logging.getLogger(__name__)

BACKOFF_S = (1.0, 30.0)  # after a timeout, lookups are misses without asking for this long (doubling), s


class LookupClient:
    """``lookup(keys)`` / ``prefix_tiers(keys)`` ask the server at ``endpoint``; wait at most ``timeout_ms``.

    After a lookup times out, the next ones are misses without asking for 1 s, doubling up to 30 s
    while the server stays silent: a scheduler step that admits many requests then waits one
    timeout, not one per request, and a dead server costs one timeout per back-off period.
    """

    def __init__(self, endpoint: str, timeout_ms: int = 2000, direct: bool = True):
        self.endpoint = endpoint
        self.direct = direct  # False: always over the socket, even to a server in this process
        self.timeout_ms = timeout_ms
        self._ctx = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._warned = False
        self._backoff_s = BACKOFF_S[0]
        self._silent_until = 0.0  # time.monotonic() before which lookups are misses without asking

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            self._socket = self._ctx.socket(zmq.REQ)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self._socket.connect(self.endpoint)
        return self._socket

    def _reset(self) -> None:
        # A REQ socket that missed its reply is stuck; a new one is the only way out.
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def prefix_tiers(self, keys: list[bytes]) -> list[str]:
        """Tiers of the leading stored chunks of ``keys``; ``[]`` when the server cannot answer."""
        reply = self.lookup(keys)
        return [] if reply is None else reply.tiers

    def lookup(self, keys: list[bytes], always: bool = False) -> LookupReply | None:
        """The server's whole answer for chain ``keys`` (tiers of the leading stored chunks, the
        measured per-chunk load cost of each tier, the P/D chunk servers); None when it cannot
        answer. Without keys it asks only if ``always`` (for the chunk servers' addresses)."""
        if not keys and not always:
            return None
        server = in_process(self.endpoint) if self.direct else None
        if server is not None:
            reply = server.answer(LookupRequest(VERSION, keys[:MAX_KEYS]), self.timeout_ms / 1e3)
            if reply is None and not self._warned:
                logger.warning("kvtier lookup server %s was busy for %d ms; treating as a miss.", self.endpoint, self.timeout_ms)
                self._warned = True
        else:
            reply = self._ask(keys)
        if reply is None:
            return None
        if reply.error:
            logger.warning("kvtier lookup refused: %s", reply.error)
            return None
        self._warned = False
        self._backoff_s = BACKOFF_S[0]
        return reply

    def _ask(self, keys: list[bytes]) -> LookupReply | None:
        """The server's reply over the socket; None when it did not answer in time or garbled it."""
        if time.monotonic() < self._silent_until:
            return None
        socket = self._connect()
        socket.send(encode(LookupRequest(VERSION, keys[:MAX_KEYS])))
        if not socket.poll(self.timeout_ms, zmq.POLLIN):
            self._reset()
            self._silent_until = time.monotonic() + self._backoff_s
            self._backoff_s = min(2 * self._backoff_s, BACKOFF_S[1])
            if not self._warned:
                logger.warning("kvtier lookup server %s did not answer in %d ms; treating as a miss.", self.endpoint, self.timeout_ms)
                self._warned = True
            return None
        try:
            return decode_reply(socket.recv())
        except (msgspec.DecodeError, ValueError) as exc:  # msgspec raises UnicodeDecodeError on bad UTF-8
            logger.warning("kvtier lookup: malformed reply from %s: %s", self.endpoint, exc)
            return None

    def close(self) -> None:
        self._reset()
