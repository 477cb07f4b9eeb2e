"""The connection of one P/D transfer to its producer's chunk server, on the decode engine's side:
what this engine brings to every transfer (:class:`Consumer`), what one transfer asks for
(:class:`FetchSpec`), and the socket's traffic (:class:`Connection`): hellos and their checked
replies, the fetches of a window, the replies taken as they come, each chunk finished as its
route has it (:class:`~kvtier.pd.route.Course`): a ZMQ frame copied, a NIXL READ into the CPU
tier waited for and its MAC checked, or engine blocks landed (:mod:`kvtier.pd.consumer.landing`).
Used by :func:`kvtier.pd.consumer.fetch.fetch_chunks`, on the thread of one transfer."""


from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import msgspec
import numpy as np
import zmq

from kvtier.jobs import Landed
from kvtier.pd.consumer.hello import PeerError, check_reply, silence
from kvtier.pd.consumer.landing import Arrived, Landings, discard
from kvtier.pd.hbm import Landing
from kvtier.pd.nixl import Agent, NixlError
from kvtier.pd.protocol import (
    VERSION, AuthError, ChunkReplies, Fetch, Hello, HelloReply, batches, check_mac, encode, mac, read_reply,
)
from kvtier.pd.route import LENT_WINDOW, Course, PushMode, Route
from kvtier.storage import ChunkBuffer

logger = logging.getLogger(__name__)

Allocate = Callable[[int], ChunkBuffer | None]  # bytes -> a buffer of the consumer's CPU tier
_CANCEL_CHECK_S, _PROGRESS_S = 0.05, 0.001  # s: a waiting transfer looks for an abort; lets NIXL progress (P WRITEs)
_QUARANTINE_TIMEOUTS = 3  # a buffer P was told to write into, never answered, is reused after this many timeouts


@dataclass(frozen=True, slots=True)
class Consumer:
    """This engine as a consumer, what its transfers share. ``hello``: its layout, as every hello
    gives it. ``timeout_ms``: longest silence (no chunk, no heartbeat) before giving up.
    ``secret``: authenticates every message (None: loopback only). ``allocate(bytes)``: a buffer
    of this engine's CPU tier, the caller's once handed out (None: no room).
    ``chunk_bytes(num_blocks)``: a chunk's size in bytes. ``nixl``: this process's agent, with the
    CPU tier's pool registered: offered to the producer, which picks NIXL or ZMQ (None: ZMQ only).
    ``block_size``: this engine's, in tokens: each chunk is asked for as ``num_blocks × block_size``
    token slots (0: as the producer stored it). ``push_mode``: ``pd_hbm_push`` (:mod:`kvtier.pd.route`)."""

    hello: Hello
    timeout_ms: int
    secret: bytes | None
    allocate: Allocate
    chunk_bytes: Callable[[int], int]
    nixl: Agent | None = None
    block_size: int = 0
    push_mode: PushMode = PushMode.READ


@dataclass(frozen=True, slots=True)
class FetchSpec:
    """One transfer to fetch: the chunks ``items`` (chain key, block count) of ``transfer_id`` from
    the chunk server at ``endpoint``. ``wait``: the producer may still be computing them (push).
    ``landing``: where chunks may be READ into the engine directly (with a NIXL agent only).
    ``producer_blocks``: P's engine blocks from the first chunk on, as its params named them.
    ``cancelled()``: checked while waiting; True stops the transfer (the request was aborted)."""

    endpoint: str
    transfer_id: str
    items: list[tuple[bytes, int]]
    wait: bool
    landing: Landing | None = None
    producer_blocks: tuple[int, ...] = ()
    cancelled: Callable[[], bool] = bool


class Connection:
    """The connection of one transfer to its producer: ``socket``, with what ``consumer`` and
    ``spec`` give, and the transfer's :class:`~kvtier.pd.route.Course`."""

    def __init__(self, socket: zmq.Socket, consumer: Consumer, spec: FetchSpec):
        self.socket, self.endpoint, self.secret, self.timeout_ms = socket, spec.endpoint, consumer.secret, consumer.timeout_ms
        self.cancelled, self.allocate, self.block_size = spec.cancelled, consumer.allocate, consumer.block_size
        self.transfer_id, self.items, self.wait = spec.transfer_id, spec.items, spec.wait  # fetched in order
        self.sizes = [consumer.chunk_bytes(n) for _, n in spec.items]  # bytes of chunk i
        self.course = Course(spec.transfer_id, spec.endpoint, spec.wait, consumer.push_mode, spec.landing is not None)
        self.nixl: Agent | None = None
        self.nixl_peer, self.nixl_metadata = "", b""
        self.landing: dict[int, ChunkBuffer] = {}  # chunk index -> buffer named to P, not answered yet
        self.early: dict[int, Arrived] = {}  # replies ahead of their turn
        self.queued: deque[Arrived] = deque()  # replies of a ChunkReplies not taken yet
        self.hbm: Landings | None = None  # chunks READ into the engine's blocks (HBM to HBM)
        self.asked: set[int] = set()  # chunks fetched, not answered yet
        self.named: set[int] = set()  # chunks whose engine blocks were named to P (push), not answered yet
        self.sent = 0  # fetches sent
        self.reply_s, self.read_s, self.reads = 0.0, 0.0, 0  # s waiting for replies and for READs into the CPU tier; READs
        self.handshake_s = 0.0  # s from connecting to the first fetch (hello, adding P's NIXL agent)
        self.nonce = b""  # of the latest hello sent: every later message carries it

    def use_nixl(self, agent: Agent, metadata: bytes) -> None:
        try:
            self.nixl_peer = agent.connect(metadata, self, self.endpoint)  # watched: kvtier.pd.consumer.peer_watch
        except Exception as exc:  # nixlBind's own errors: bad metadata, UCX could not reach it
            raise PeerError(f"could not reach {self.endpoint} over NIXL: {exc}") from None
        self.nixl, self.nixl_metadata = agent, metadata

    def hello(self, hello: Hello, sent: bool = False) -> HelloReply:
        """Send ``hello`` (unless ``sent`` already); the producer's checked reply (raises :class:`PeerError`)."""
        if not sent:
            self.nonce = hello.nonce
            self.send(hello)
        reply = self.receive()
        if not isinstance(reply, HelloReply):
            raise PeerError(f"{self.endpoint} answered the handshake with {type(reply).__name__}")
        check_reply(self.endpoint, hello, reply)
        return reply

    def settle_writes(self) -> None:
        """After a release asking for an answer: wait until P says none of its WRITEs here still runs, up
        to twice the timeout (P gives up on a WRITE one timeout after posting it: :mod:`kvtier.pd.producer.writes`)."""
        deadline = time.monotonic() + 2 * self.timeout_ms / 1000
        try:
            while time.monotonic() < deadline:
                if (got := self.receive(block=False)) is None:
                    self.socket.poll(1 if self.course.route.writes else 50)
                elif got.reply.status == "released":
                    return
                else:
                    self._discard(got)
            raise PeerError(f"no answer for {2 * self.timeout_ms} ms")
        except PeerError as exc:
            logger.warning("kvtier P/D: %s did not confirm that its WRITEs into this engine ended (%s).",
                           self.endpoint, exc)

    def send(self, message: msgspec.Struct) -> None:
        body = encode(message)
        self.socket.send_multipart([mac(self.secret, body), body], flags=zmq.NOBLOCK)

    def receive(self, block: bool = True) -> HelloReply | Arrived | None:
        """The next authenticated reply; heartbeats extend the deadline. Raises PeerError. A NIXL
        chunk reply is authenticated once its bytes are read (:meth:`chunk`). ``block=False``:
        None at once when no reply is waiting."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        while not self.queued:
            left = deadline - time.monotonic()
            if left <= 0 and not self.socket.poll(0, zmq.POLLIN):  # a thread woken late still takes what came
                self.course.went_silent()
                raise PeerError(silence(self.endpoint, self.timeout_ms, bool(self.secret) and not self.handshake_s))
            if self.course.route.writes:  # P WRITEs into our buffers: NIXL needs this side's progress too
                self.nixl.progress()
            if not block and not self.socket.poll(0, zmq.POLLIN):
                return None
            wait_s = _PROGRESS_S if self.course.route.writes else _CANCEL_CHECK_S
            if not self.socket.poll(max(1, int(min(max(left, 0), wait_s) * 1000)), zmq.POLLIN):
                if self.cancelled():
                    raise PeerError("the request was aborted")
                continue
            frames = self.socket.recv_multipart(copy=False)
            try:
                reply = read_reply(frames, self.secret, lent_unchecked=self.nixl is not None)
            except (AuthError, msgspec.DecodeError, ValueError) as exc:  # UnicodeDecodeError on bad UTF-8
                raise PeerError(f"bad reply from {self.endpoint}: {exc}") from None
            tag, body, payload = frames[0].bytes, frames[1].bytes, frames[2] if len(frames) == 3 else None
            if isinstance(reply, ChunkReplies):
                self.queued.extend(Arrived(r, tag=tag, body=body) for r in reply.replies)
                continue
            if isinstance(reply, HelloReply):
                return reply
            if reply.status == "pending":
                deadline = time.monotonic() + self.timeout_ms / 1000
                continue
            if reply.status == "refused":
                raise PeerError(f"{self.endpoint} refused a request: {reply.error}")
            return Arrived(reply, payload, tag=tag, body=body)
        return self.queued.popleft()

    def chunk(self, index: int) -> ChunkBuffer:
        begin = time.perf_counter()
        while index not in self.early:
            self._take(self.receive())
        if self.course.asks_rest() and self.hbm.unposted(index):
            self.fetch_until(index + LENT_WINDOW)  # P lends its blocks: ask for the rest, READ them at once
            while self.asked:  # (each READ's posting maps P's regions: one READ, not two)
                self._take(self.receive())
        self.reply_s += time.perf_counter() - begin
        while (got := self.receive(block=self.course.waits_for_turn() and bool(self.asked))) is not None:  # replies here, the rest of P's
            self._take(got)  # turn: their READs start now (one for the turn), while the caller scatters this chunk
        if self.hbm is not None:
            self.hbm.post(index)
        arrived = self.early.pop(index)
        nbytes = self.sizes[index]
        if arrived.reply.status != "ok":
            raise PeerError(f"{self.endpoint} no longer has chunk {index} ({arrived.reply.status})")
        if arrived.reply.blocks:
            return self._finish_landed(index, arrived)
        if arrived.payload is None:
            return self._finish_read(index, arrived)
        payload, buffer, arrived.buffer = arrived.payload, arrived.buffer, None
        if len(payload.buffer) != nbytes:
            if buffer is not None:
                buffer.release()
            raise PeerError(f"{self.endpoint} sent chunk {index} of {len(payload.buffer)} B, expected {nbytes} B")
        buffer = buffer or self.allocate(nbytes)
        if buffer is None:
            raise PeerError(f"no room in this engine's CPU tier for a {nbytes} B chunk")
        np.copyto(buffer.data.numpy(), np.frombuffer(payload.buffer, dtype=np.uint8))
        return buffer

    def fetch_until(self, end: int) -> None:
        """Ask for the transfer's chunks not asked yet, up to (not including) chunk ``end``, in as
        few messages as :func:`~kvtier.pd.protocol.batches` makes."""
        items = self.items
        fetches = [self.fetch(self.transfer_id, i, *items[i], self.wait) for i in range(self.sent, min(end, len(items)))]
        self.sent += len(fetches)
        self.course.posted()
        for message in batches(fetches):
            self.send(message)

    def fetch(self, transfer_id: str, index: int, key: bytes, num_blocks: int, wait: bool) -> Fetch:
        """The fetch of chunk ``index``; in a push transfer over NIXL, naming where P may WRITE it:
        the chunk's engine blocks (HBM to HBM), else a buffer of this engine's CPU tier."""
        # an emulated path found by the first READs ends HBM fetches from then on, mid-transfer too
        hbm = self.hbm is not None and self.hbm.wants(index)
        blocks = self.hbm.mine.block_ids[index] if hbm and self.course.route is Route.HBM_WRITE else ()
        address = capacity = 0
        if blocks:  # push into the engine's blocks: no buffer of the CPU tier needed
            self.named.add(index)
        elif self.course.route.writes and (buffer := self.allocate(self.sizes[index])) is not None:
            self.landing[index] = buffer
            address, capacity = buffer.data.data_ptr(), self.sizes[index]
        self.asked.add(index)
        return Fetch(VERSION, transfer_id, index, key, num_blocks, wait, address, capacity,
                     num_blocks * self.block_size, hbm, blocks, self.nonce)

    def _take(self, got: HelloReply | Arrived) -> None:
        if isinstance(got, HelloReply):
            raise PeerError(f"{self.endpoint} sent a second handshake reply")
        if not 0 <= got.reply.index < len(self.sizes) or got.reply.index in self.early:
            raise PeerError(f"{self.endpoint} answered for chunk {got.reply.index}, which was not asked")
        self.early[got.reply.index] = got
        self.course.replied(got.reply)
        self.named.discard(got.reply.index)  # P answered: it will not write there later
        self.asked.discard(got.reply.index)
        landing = self.landing.pop(got.reply.index, None)
        if landing is not None and (got.reply.status != "ok" or got.reply.blocks):
            landing.release()  # not answered, or from P's engine blocks: the buffer named goes unused
        if self.hbm is not None and not got.reply.blocks:  # comes otherwise: nothing lands in its blocks
            self.hbm.settle_early(got.reply.index)  # while an early READ may still write there
        if got.reply.status != "ok":
            return
        if got.reply.blocks:
            if self.hbm is not None and not got.reply.written:
                self.hbm.add(got)  # READ with the other replies at hand (chunk() posts them)
            return
        got.buffer = landing
        if got.payload is None and not got.reply.written:
            self._start_read(got)

    def _start_read(self, arrived: Arrived) -> None:
        """Post the READ of a lent chunk into a fresh buffer (a failure is raised by its turn)."""
        reply, nbytes = arrived.reply, self.sizes[arrived.reply.index]
        if reply.nbytes != nbytes or self.nixl is None:
            return
        buffer = arrived.buffer = arrived.buffer or self.allocate(nbytes)
        if buffer is None:
            return
        try:
            arrived.transfer = self.nixl.read(self.nixl_peer, [(buffer.data.data_ptr(), nbytes)],
                                              [(reply.address, nbytes)])
        except NixlError:
            pass  # reported when its turn comes

    def _finish_landed(self, index: int, arrived: Arrived) -> Landed:
        try:
            if self.hbm is None:
                raise PeerError(f"{self.endpoint} named engine blocks for chunk {index}, which this engine did not ask")
            return self.hbm.finish(index, arrived, self.timeout_ms / 1000, self.cancelled, self.early.get(index + 1))
        except NixlError as exc:
            self.course.broke_nixl()
            self._discard(arrived)
            raise PeerError(f"{self.endpoint}, chunk {index}: {exc}") from None
        except BaseException:
            self._discard(arrived)
            raise

    def _finish_read(self, index: int, arrived: Arrived) -> ChunkBuffer:
        reply, buffer, transfer, nbytes = arrived.reply, arrived.buffer, arrived.transfer, self.sizes[index]
        try:
            if self.nixl is None:
                raise PeerError(f"{self.endpoint} lent chunk {index} but NIXL was not agreed on")
            if reply.written:  # P wrote it into the buffer this fetch named
                if buffer is None or reply.nbytes != nbytes:
                    raise PeerError(f"{self.endpoint} says it wrote chunk {index}, but not into a buffer of "
                                    f"{nbytes} B this engine named")
            else:  # P lent it: read it
                if reply.nbytes != nbytes:
                    raise PeerError(f"{self.endpoint} lent chunk {index} of {reply.nbytes} B, expected {nbytes} B")
                if buffer is None:
                    raise PeerError(f"no room in this engine's CPU tier for a {nbytes} B chunk")
                if transfer is None:
                    raise PeerError(f"NIXL could not post the READ of chunk {index} from {self.endpoint}")
                begin = time.perf_counter()
                try:
                    transfer.wait(self.timeout_ms / 1000, self.cancelled)
                except NixlError as exc:
                    self.course.broke_nixl()  # forgotten once its READs are settled (close)
                    raise PeerError(f"NIXL READ of chunk {index} from {self.endpoint}: {exc}") from None
                self.read_s, self.reads = self.read_s + time.perf_counter() - begin, self.reads + 1
            try:
                check_mac(self.secret, arrived.tag, arrived.body, memoryview(buffer.data.numpy()))
            except AuthError as exc:
                raise PeerError(f"bad chunk {index} from {self.endpoint}: {exc}") from None
        except BaseException:
            self._discard(arrived)
            raise
        if transfer is not None:
            transfer.release()
        return buffer

    def _discard(self, arrived: Arrived) -> None:
        """Release a chunk that will not be handed out (:func:`kvtier.pd.consumer.landing.discard`)."""
        discard(arrived, self.hbm, self.endpoint, self.timeout_ms / 1000)

    def close(self) -> None:
        """Settle and release every READ and buffer not handed out."""
        if self.reads:  # the caller scatters each chunk while the next ones are READ
            logger.debug("kvtier P/D: %d chunks READ from %s into this engine's CPU tier; ms handshake %.1f, waiting for "
                         "replies %.1f, for READs %.1f", self.reads, self.endpoint, self.handshake_s * 1e3,
                         self.reply_s * 1e3, self.read_s * 1e3)
        while self.early:
            self._discard(self.early.popitem()[1])
        if self.landing:  # named to P, never answered: P might still write there; kept out of use a while
            grace_s = _QUARANTINE_TIMEOUTS * self.timeout_ms / 1000
            for timer in [threading.Timer(grace_s, buffer.release) for buffer in self.landing.values()]:
                timer.daemon = True
                timer.start()
            self.landing.clear()
        if self.course.nixl_failed and self.nixl is not None:
            self.nixl.forget(self.nixl_metadata)  # a restarted producer comes back under a new name
        elif self.nixl is not None:  # kept while its chunk server is up (peer_watch), else dropped once idle
            self.nixl.disconnect(self.nixl_peer, self)
