"""Rank 0's lookup server: one ROUTER socket, served by one daemon thread that owns the index.

Scheduler lookups (REQ) are answered from the :class:`HoldIndex`; worker hold reports (DEALER)
update it and get no answer. Where the ranks' own tiers stop, the shared tier (a Redis/Valkey
server, when configured) is asked which of the next chunks it holds for every rank, in one round
trip; those chunks are answered as tier ``"shared"``. Both arrive on the same socket, so a report sent before a lookup is
applied before that lookup is answered. A bad message is logged and answered with an error;
the server keeps serving.

A scheduler in the server's own process (TP=1: vLLM runs rank 0's worker in the engine's
process) asks :meth:`LookupServer.answer` directly (:func:`in_process`): the same answer, without
the round trip and without waking the server's thread; rank 0's reporter hands its reports over
the same way. One lock orders those with the messages the thread handles.
"""

from __future__ import annotations

import glob
import logging
import os
import socket
import threading
import time
from typing import Callable

import msgspec
import zmq

from kvtier.lookup.index import HoldIndex
from kvtier.lookup.protocol import (
    MAX_MESSAGE_BYTES, VERSION, HoldReport, LookupReply, LookupRequest, PeerAddress, decode_message, encode,
)

logger = logging.getLogger(__name__)

LoadCosts = Callable[[], dict[str, float]]
Probed = Callable[[], list[str]]
# (each chunk's storage key per rank, each rank's fingerprint) -> how many leading chunks the
# shared tier holds for every rank; must answer within the server's shared timeout.
SharedPrefix = Callable[[list[tuple[bytes, ...]], tuple[bytes, ...]], int]
MAX_SHARED_CHUNKS = 1024  # chunks past the local hit asked of the shared tier per lookup
_IN_PROCESS: dict[str, LookupServer] = {}  # endpoint -> the server this process runs there


def in_process(endpoint: str) -> LookupServer | None:
    """The server this process runs at ``endpoint`` (None: it runs elsewhere, or none does)."""
    return _IN_PROCESS.get(endpoint)


class LookupServer:
    """Serves lookups for a TP group of ``world_size`` ranks at ``endpoint``.

    ``endpoint``: a ZMQ endpoint to bind (``ipc://path`` or ``tcp://127.0.0.1:port``).
    ``chunk_load_ms``: measured ms to load one chunk per tier, sent with every reply.
    ``shared_prefix``: asks the shared tier (None: there is none). ``probed``: the tiers whose
    ``chunk_load_ms`` figure started from a read speed measured at start, sent with every reply.
    """

    def __init__(self, endpoint: str, world_size: int, chunk_load_ms: LoadCosts | None = None,
                 shared_prefix: SharedPrefix | None = None, probed: Probed | None = None):
        self.endpoint = endpoint
        self.index = HoldIndex(world_size)
        self.world_size = world_size
        self._endpoints: dict[int, str] = {}  # rank -> its P/D chunk server
        self._chunk_load_ms = chunk_load_ms or dict
        self._shared_prefix = shared_prefix
        self._probed = probed or list
        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        path = endpoint[6:] if endpoint.startswith("ipc://") else None
        if path and os.path.exists(path):
            os.unlink(path)  # a socket file left by a process that died
        if path:
            sweep_stale(os.path.dirname(path))
        self._socket.bind(endpoint)
        if path:
            os.chmod(path, 0o600)  # only this user's processes may ask or report
        self._lock = threading.Lock()  # the index is read by answer() and changed by the thread
        self._stop = threading.Event()
        _IN_PROCESS[endpoint] = self
        self._thread = threading.Thread(target=self._serve, name="kvtier-lookup", daemon=True)
        self._thread.start()

    def _handle(self, message: bytes) -> LookupReply | None:
        """The reply to ``message``; None for an accepted hold report."""
        try:
            request = decode_message(message)
        except (msgspec.DecodeError, ValueError) as exc:  # ValidationError, and UnicodeDecodeError on bad UTF-8
            logger.warning("kvtier lookup: rejected a malformed message (%d bytes): %s", len(message), exc)
            return LookupReply(VERSION, [], error=f"malformed message: {exc}")
        if request.version != VERSION:
            logger.warning("kvtier lookup: rejected protocol version %d (this is %d).", request.version, VERSION)
            return LookupReply(VERSION, [], error=f"protocol version {request.version} != {VERSION}")
        with self._lock:
            return self._reply(request)

    def answer(self, request: LookupRequest | HoldReport | PeerAddress, timeout_s: float = -1) -> LookupReply | None:
        """The reply to a lookup made in this process, as the socket would carry it; a report is
        applied before this returns (None, or the refusal). None also when the server's thread
        held the index for ``timeout_s`` (-1: wait for it)."""
        if not self._lock.acquire(timeout=timeout_s):
            return None
        try:
            return self._reply(request)
        finally:
            self._lock.release()

    def _reply(self, request: LookupRequest | HoldReport | PeerAddress) -> LookupReply | None:
        try:
            if isinstance(request, PeerAddress):
                if request.world_size != self.world_size or request.rank >= self.world_size:
                    return LookupReply(VERSION, [], error=f"rank {request.rank}/{request.world_size} is not in this "
                                                          f"group of {self.world_size}")
                self._endpoints[request.rank] = request.endpoint
                return None
            if isinstance(request, HoldReport):
                problem = self.index.apply(request)
                if problem is None:
                    return None
                logger.warning("kvtier lookup: rejected a hold report: %s.", problem)
                return LookupReply(VERSION, [], error=problem)
            endpoints = [self._endpoints.get(r, "") for r in range(self.world_size)]
            return LookupReply(VERSION, self._tiers(request.keys), chunk_load_ms=self._chunk_load_ms(),
                               probed=self._probed(),
                               endpoints=endpoints if all(endpoints) else [])
        except Exception as exc:  # a bad message must never take the server down
            logger.exception("kvtier lookup failed")
            return LookupReply(VERSION, [], error=f"lookup failed: {exc}")

    def _tiers(self, keys: list[bytes]) -> list[str]:
        tiers = self.index.prefix_tiers(keys)
        if self._shared_prefix is None or len(tiers) == len(keys):
            return tiers
        known = self.index.ranks_keys(keys[len(tiers) : len(tiers) + MAX_SHARED_CHUNKS])
        if known is None:
            return tiers
        fingerprints, chunks = known
        held = self._shared_prefix(chunks, fingerprints)
        if held < len(chunks):  # other TP sizes' pieces of the rest, all of one way (pieces share a namespace)
            rest = keys[len(tiers) + held : len(tiers) + len(chunks)]
            held += max((self._shared_prefix(rows, (fingerprints[0],) * len(rows[0]))
                         for rows in self.index.cover_rows(rest)), default=0)
        return tiers + ["shared"] * held

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            # [peer identity, (empty delimiter of REQ and reporters,) payload]
            frames = self._socket.recv_multipart()
            if len(frames) < 2:
                continue
            reply = self._handle(frames[-1])
            if reply is not None:
                self._socket.send_multipart([*frames[:-1], encode(reply)])
        self._socket.close()

    def close(self) -> None:
        """Stop serving and release the socket (idempotent)."""
        if _IN_PROCESS.get(self.endpoint) is self:
            del _IN_PROCESS[self.endpoint]
        self._stop.set()
        self._thread.join(timeout=5)
        if self.endpoint.startswith("ipc://") and os.path.exists(self.endpoint[6:]):
            os.unlink(self.endpoint[6:])


STALE_S = 60.0  # a lookup socket file refusing connections at least this old belongs to no server


def sweep_stale(directory: str) -> int:
    """Remove the lookup socket files in ``directory`` (``kvtier-lookup-*.sock``, named after each
    engine) that no server listens on any more: an engine killed (vLLM ends its workers that way)
    leaves its file behind, and the next engine gets a new name. A file counts as left behind when
    it is older than :data:`STALE_S` and refuses a connection; returns how many went."""
    removed = 0
    for path in glob.glob(os.path.join(directory, "kvtier-lookup-*.sock")):
        try:
            if time.time() - os.lstat(path).st_mtime < STALE_S:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.1)
                probe.connect(path)  # a server listens: left alone
        except ConnectionRefusedError:
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
        except OSError:  # gone meanwhile, not a socket, not ours: left alone
            continue
    if removed:
        logger.debug("kvtier lookup: removed %d socket files of lookup servers that ended", removed)
    return removed
