"""A decode engine's side of a transfer: fetch chunks from one producer rank's chunk server.

One DEALER socket per transfer (a timed-out transfer's late replies can never reach the next),
a handshake that compares layouts, then a window of fetches in flight: while the caller
verifies and scatters chunk ``i``, chunks ``i+1 …`` are on the wire (ZMQ's I/O thread receives
them). Any failure raises :class:`PeerError` after the chunks that did arrive were yielded.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

import msgspec
import numpy as np
import zmq

from kvtier.pd.protocol import (
    VERSION, AuthError, ChunkReply, Fetch, Hello, HelloReply, Release, check_mac, decode_reply, encode, mac,
)
from kvtier.storage import ChunkBuffer

logger = logging.getLogger(__name__)

WINDOW = 4  # fetches in flight per transfer
_CANCEL_CHECK_S = 0.05  # how often a waiting transfer checks whether its request was aborted
Allocate = Callable[[int], ChunkBuffer | None]  # bytes -> a buffer of the consumer's CPU tier
_warned: set[str] = set()  # peers whose layout mismatch was logged (one line per peer)


class PeerError(RuntimeError):
    """The producer could not deliver: unreachable, timed out, refused, mismatched or missing."""


def fetch_chunks(endpoint: str, hello: Hello, transfer_id: str, items: list[tuple[bytes, int]], *,
                 wait: bool, timeout_ms: int, secret: bytes | None, allocate: Allocate,
                 chunk_bytes: Callable[[int], int], cancelled: Callable[[], bool] = bool) -> Iterator[ChunkBuffer]:
    """Yield the chunks ``items`` (chain key, block count) of ``transfer_id`` from ``endpoint``, in
    order, each in a fresh buffer from ``allocate`` that the caller owns.

    ``wait``: the producer may still be computing them (push). ``timeout_ms``: longest silence
    (no chunk, no heartbeat) before giving up. ``chunk_bytes(num_blocks)``: a chunk's size.
    ``cancelled()``: checked while waiting; True stops the transfer (the request was aborted).
    Tells the producer it is done (releases its pins) when the generator ends, however it ends.
    """
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 200)
    socket.setsockopt(zmq.MAXMSGSIZE, max(chunk_bytes(n) for _, n in items) + (64 << 10))
    socket.connect(endpoint)
    peer = _Peer(socket, endpoint, secret, timeout_ms, cancelled)
    try:
        peer.send(hello)
        reply = peer.receive()
        if not isinstance(reply, HelloReply):
            raise PeerError(f"{endpoint} answered the handshake with {type(reply).__name__}")
        _check_layouts(endpoint, hello, reply)
        sent = 0
        for index, (key, num_blocks) in enumerate(items):
            while sent < len(items) and sent < index + WINDOW:
                peer.send(Fetch(VERSION, transfer_id, sent, items[sent][0], items[sent][1], wait))
                sent += 1
            yield peer.chunk(index, chunk_bytes(num_blocks), allocate)
    finally:
        try:
            peer.send(Release(VERSION, transfer_id))
        except zmq.ZMQError:
            pass
        socket.close()


class _Peer:
    def __init__(self, socket: zmq.Socket, endpoint: str, secret: bytes | None, timeout_ms: int,
                 cancelled: Callable[[], bool]):
        self.socket = socket
        self.cancelled = cancelled
        self.endpoint = endpoint
        self.secret = secret
        self.timeout_ms = timeout_ms
        self.early: dict[int, tuple[ChunkReply, zmq.Frame | None]] = {}  # replies ahead of their turn

    def send(self, message: msgspec.Struct) -> None:
        body = encode(message)
        self.socket.send_multipart([mac(self.secret, body), body], flags=zmq.NOBLOCK)

    def receive(self) -> HelloReply | tuple[ChunkReply, zmq.Frame | None]:
        """The next authenticated reply; heartbeats extend the deadline. Raises PeerError."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"{self.endpoint} sent nothing for {self.timeout_ms} ms")
            if not self.socket.poll(max(1, int(min(left, _CANCEL_CHECK_S) * 1000)), zmq.POLLIN):
                if self.cancelled():
                    raise PeerError("the request was aborted")
                continue
            frames = self.socket.recv_multipart(copy=False)
            if len(frames) not in (2, 3):
                raise PeerError(f"{self.endpoint} sent {len(frames)} frames")
            tag, body = frames[0].bytes, frames[1].bytes
            payload = frames[2] if len(frames) == 3 else None
            try:
                check_mac(self.secret, tag, body, None if payload is None else payload.buffer)
                reply = decode_reply(body)
            except (AuthError, msgspec.DecodeError, ValueError) as exc:  # UnicodeDecodeError on bad UTF-8
                raise PeerError(f"bad reply from {self.endpoint}: {exc}") from None
            if reply.version != VERSION:
                raise PeerError(f"{self.endpoint} speaks protocol version {reply.version}, this is {VERSION}")
            if isinstance(reply, HelloReply):
                return reply
            if reply.status == "pending":
                deadline = time.monotonic() + self.timeout_ms / 1000
                continue
            if reply.status == "refused":
                raise PeerError(f"{self.endpoint} refused a request: {reply.error}")
            return reply, payload

    def chunk(self, index: int, nbytes: int, allocate: Allocate) -> ChunkBuffer:
        while index not in self.early:
            got = self.receive()
            if isinstance(got, HelloReply):
                raise PeerError(f"{self.endpoint} sent a second handshake reply")
            self.early[got[0].index] = got
        reply, payload = self.early.pop(index)
        if reply.status != "ok" or payload is None:
            raise PeerError(f"{self.endpoint} no longer has chunk {index} ({reply.status})")
        if len(payload.buffer) != nbytes:
            raise PeerError(f"{self.endpoint} sent chunk {index} of {len(payload.buffer)} B, expected {nbytes} B")
        buffer = allocate(nbytes)
        if buffer is None:
            raise PeerError(f"no room in this engine's CPU tier for a {nbytes} B chunk")
        np.copyto(buffer.data.numpy(), np.frombuffer(payload.buffer, dtype=np.uint8))
        return buffer


def _check_layouts(endpoint: str, hello: Hello, reply: HelloReply) -> None:
    problem = reply.error
    if not problem and reply.fingerprint != hello.fingerprint:
        problem = f"KV layouts differ: this engine has {hello.layout}; the producer has {reply.layout}"
    if not problem and reply.chunk_tokens != hello.chunk_tokens:
        problem = f"chunk_tokens differ: {hello.chunk_tokens} here, {reply.chunk_tokens} on the producer"
    if problem:
        if endpoint not in _warned:
            _warned.add(endpoint)
            logger.warning("kvtier P/D: not loading from %s (%s); recomputing.", endpoint, problem)
        raise PeerError(problem)
