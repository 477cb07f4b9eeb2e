"""Worker-side lookup server: a REP socket served by one daemon thread."""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

import msgspec
import zmq

from kvtier.lookup.protocol import MAX_MESSAGE_BYTES, VERSION, LookupReply, decode_request, encode

logger = logging.getLogger(__name__)

Answer = Callable[[list[bytes]], list[str]]


class LookupServer:
    """Answers :class:`LookupRequest` with ``answer(keys)``; bad messages get an error reply, never a crash.

    ``endpoint``: a ZMQ endpoint to bind (``ipc://path`` or ``tcp://127.0.0.1:port``).
    """

    def __init__(self, endpoint: str, answer: Answer):
        self.endpoint = endpoint
        self._answer = answer
        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if endpoint.startswith("ipc://") and os.path.exists(endpoint[6:]):
            os.unlink(endpoint[6:])  # a socket file left by a process that died
        self._socket.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvtier-lookup", daemon=True)
        self._thread.start()

    def _reply(self, message: bytes) -> LookupReply:
        try:
            request = decode_request(message)
        except msgspec.DecodeError as exc:
            logger.warning("kvtier lookup: rejected a malformed message (%d bytes): %s", len(message), exc)
            return LookupReply(VERSION, [], error=f"malformed request: {exc}")
        if request.version != VERSION:
            logger.warning("kvtier lookup: rejected protocol version %d (this is %d).", request.version, VERSION)
            return LookupReply(VERSION, [], error=f"protocol version {request.version} != {VERSION}")
        try:
            return LookupReply(VERSION, self._answer(request.keys))
        except Exception as exc:  # a lookup must never take the server down
            logger.exception("kvtier lookup failed")
            return LookupReply(VERSION, [], error=f"lookup failed: {exc}")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            self._socket.send(encode(self._reply(self._socket.recv())))
        self._socket.close()

    def close(self) -> None:
        """Stop serving and release the socket (idempotent)."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self.endpoint.startswith("ipc://") and os.path.exists(self.endpoint[6:]):
            os.unlink(self.endpoint[6:])
