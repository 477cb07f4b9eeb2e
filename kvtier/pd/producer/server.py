"""A prefill engine's chunk server: one per TP rank, one ZMQ ROUTER socket, one daemon thread.

Serves the sealed chunks of this rank's store to decode engines by chain key. A chunk not stored
yet but coming (its save is queued, or its transfer is still being computed: push) is sent the
moment it is; meanwhile the peer gets a ``pending`` heartbeat every quarter of ``timeout_ms``
while the transfer is alive (a step computed it within :data:`ACTIVE_S`). A malformed,
oversized, unauthenticated or wrong-version message is refused and logged; the server keeps serving.
So is a replayed or unbound one (:mod:`kvtier.pd.producer.handshakes`): a hello whose nonce was seen or
that was sent outside the window gets no metadata, and a fetch or release from a connection
other than the one its hello (or its transfer) is bound to changes nothing. With a secret the
socket speaks ZMQ CURVE (:mod:`kvtier.pd.channel`).

Over NIXL (a peer that offered it, when this process has an agent) a chunk is not sent but lent:
the reply carries its address in the registered CPU pool, and the server keeps the chunk's buffer
until the peer releases the transfer, or has asked nothing for twice ``timeout_ms``
(:mod:`kvtier.pd.producer.lending`); over ZMQ it is sent without a copy and its buffer kept until ZMQ
let go of it (:mod:`kvtier.pd.producer.sent`). A push peer names a buffer of its own in each fetch: the chunk is
written there (a NIXL WRITE posted on this thread) and the reply says so. While NIXL peers are
known the thread wakes every 10 ms (1 ms while a WRITE runs) to let NIXL progress (:mod:`kvtier.pd.nixl`).

HBM to HBM (:attr:`ChunkServer.engine` set once the engine KV is registered with NIXL): see
:mod:`kvtier.pd.producer.hbm_serve`. A pull fetch for a transfer whose lease should begin any moment
(its request finished computing) waits for it up to :data:`EXPECT_S`; without a lease the chunk
is lent or sent from the CPU tier as above. A release that asks for an answer gets it once no
WRITE of its transfer runs; each WRITE is abandoned ``timeout_ms`` after its posting (:mod:`kvtier.pd.producer.writes`).
A fetch naming engine blocks beyond the consumer's (its hello's ``num_blocks``), or not as many as its chunk's,
is refused before any WRITE is built.

A decode engine of another TP size asks for the piece of the KV heads this rank holds (its hello names
the piece's fingerprint); one of more TP ranks reads each transfer over as many connections, and the
transfer's chunks and blocks stay held until the last of them releases it. The server's thread and the
state every message touches are one piece: that thread alone reads and writes it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import msgspec
import zmq

from kvtier.keys import storage_key
from kvtier.pd.channel import HandshakeFailures, bind_router
from kvtier.pd.producer.handshakes import Handshakes
from kvtier.pd.hbm import EngineBlocks
from kvtier.pd.producer.hbm_serve import HbmServing
from kvtier.pd.producer.holds import PublishHolds
from kvtier.pd.producer.lending import LentBuffers
from kvtier.pd.nixl import Agent
from kvtier.pd.producer.recut import recut
from kvtier.pd.producer.sent import SentBuffers
from kvtier.pd.producer.peers import Peers
from kvtier.pd.producer.slicing import Cutter, rank_part
from kvtier.pd.producer.waiting import WaitingFetches
from kvtier.pd.producer.writes import PeerWrites
from kvtier.pd.route import producer_route
from kvtier.pd.protocol import (
    MAX_REQUEST_BYTES, VERSION, AuthError, ChunkReply, Fetch, Fetches, Hello, HelloReply, Release, ServedLayout,
    check_mac, decode_request, encode, mac,
)
from kvtier.storage import ChunkBuffer, ChunkStore

logger = logging.getLogger(__name__)

# A published request is alive this long after a step began computing it: one prefill step may
# outlast pd_timeout_ms by far, and the waiting consumer must not give up meanwhile. An aborted
# producer request therefore keeps its consumer waiting this long, at most.
ACTIVE_S = 60.0
_SEND_HWM = 1024  # replies queued per peer: above any consumer's fetches in flight (route.PUSH_WINDOW)
_LOG_EVERY = 100  # rejected messages: the first, then one log line per this many
EXPECT_S = 0.5  # most seconds an HBM fetch waits for its transfer's lease to begin
PEER_IDLE_S = 5.0  # a peer's NIXL agent (a consumer written into, a producer read from) unused this long is dropped


class ChunkServer:
    """Serves ``store``'s chunks at ``bind`` (``tcp://host:port``, port 0 for a free one).

    ``holds``: published transfers. ``saving(storage_key)``: a save of that chunk is queued.
    ``secret``: authenticates every message both ways (None: no authentication, loopback only).
    ``nixl``: this process's NIXL agent with the CPU pool registered (None: ZMQ only).
    """

    def __init__(self, bind: str, store: ChunkStore, holds: PublishHolds, layout: ServedLayout,
                 saving: Callable[[bytes], bool], secret: bytes | None, timeout_ms: int,
                 nixl: Agent | None = None):
        self.store = store
        self.nixl = nixl
        self._lease_wait = False  # a fetch waits for a lease: look again at the next turn of the loop
        self._writes = PeerWrites(self._send, self._retry, timeout_ms / 1000)  # WRITEs not done yet, releases to answer
        self._hbm = HbmServing(self._send, self._writes)
        self._peers = Peers(lambda: self.nixl, self._hbm)  # each decode connection's route, heads and NIXL side
        self.served_total = 0  # chunks answered "ok" since start, lent or sent
        self._cutter = Cutter(store)  # chunks cut to a decode rank's part of the heads
        self._lend_s = 2 * timeout_ms / 1000
        self._lent = LentBuffers(self._send, self._lend_s)  # CPU-tier buffers lent to NIXL peers
        self._sent = SentBuffers()  # buffers of replies ZMQ still reads
        self.holds = holds
        self.layout = layout
        self._saving = saving
        self._secret = secret
        self._heartbeat_s = timeout_ms / 4000
        self._active_s = max(ACTIVE_S, timeout_ms / 1000)
        self.rejected = self.received_total = self.sent_total = 0  # messages refused, taken (a Fetches is one), sent
        self.dropped = 0  # replies not sent: the peer's queue was full
        self._waiting = WaitingFetches()
        self.pushing = False  # WRITEs into a consumer run or wait for chunks (read by the engine thread)
        self._handshakes = Handshakes(10 * self._active_s, layout.tp_size)  # nonces seen, connections bound to their hello
        self._from = ""  # the address of the peer whose message is being handled (log lines)
        self._socket, self.port = bind_router(bind, secret, MAX_REQUEST_BYTES, _SEND_HWM)
        self._curve_failures = HandshakeFailures(self._socket, _LOG_EVERY)  # peers of another secret (CURVE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvtier-pd-server", daemon=True)
        self._thread.start()

    # ---- the server thread -----------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        last_beat = last_expire = time.monotonic()
        while not self._stop.is_set():
            busy = self._writes or self._hbm.sums_pending
            events = dict(poller.poll(1 if busy else 10 if self._waiting or self._peers.over_nixl else 100))
            if self._lease_wait:  # a fetch waits for a lease, which no announcement wakes: look again
                self._lease_wait = False
                self.holds.changed.set()
            try:
                if events:
                    for _ in range(64):  # bounded, so waiting fetches and expiry still run
                        try:
                            frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._from = frames[-1].get("Peer-Address") or "?"
                        self._handle([f.bytes for f in frames])
                self.rejected += self._curve_failures.take()
                self._sent.release_done()
                if self._peers.over_nixl:
                    self.nixl.progress()
                if self._writes:
                    self._writes.poll()
                came = self._hbm.sums_came()  # chunks just computed: their waiting fetches may be answered now
                now = time.monotonic()
                self._serve_waiting(now, came)
                self._hbm.flush(self.nixl)  # one WRITE per peer for what this turn's fetches found stored
                self.pushing = bool(self._writes) or self._waiting.pushing
                if now - last_beat >= self._heartbeat_s:
                    self._heartbeat()
                    last_beat = now
                if now - last_expire >= 1.0:
                    if self._waiting:  # a save that was dropped or failed never announces itself:
                        self.holds.changed.set()  # look again, once a second, whether it is still coming
                    self.holds.expire()
                    self._expire_lent(now)
                    self._handshakes.expire(now)
                    last_expire = now
            except Exception:  # the server must outlive any one message
                logger.exception("kvtier P/D chunk server: unexpected error; still serving")
        self._lent.close()
        self._cutter.close()
        self._writes.settle(self._lend_s)
        self._curve_failures.close()
        self._socket.close()
        self._sent.close()

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 3:
            return self._reject(identity, f"{len(frames) - 1} frames instead of 2")
        tag, body = frames[1], frames[2]
        try:
            check_mac(self._secret, tag, body)
            message = decode_request(body)
        except (AuthError, msgspec.DecodeError, ValueError) as exc:  # UnicodeDecodeError on bad UTF-8
            return self._reject(identity, str(exc))
        inner = message.fetches if isinstance(message, Fetches) else ()
        if versions := {message.version, *(f.version for f in getattr(message, "fetches", ()))} - {VERSION}:
            return self._reject(identity, f"protocol version {min(versions)} != {VERSION}")
        problem = (self._handshakes.hello(identity, message) if isinstance(message, Hello) else
                   self._handshakes.release(identity, message) if isinstance(message, Release) else
                   self._handshakes.message(identity, message.nonce))
        if problem:  # a replay, or a hello that cannot be: no metadata, nothing changed
            return self._reject(identity, problem)
        self.received_total += 1
        if isinstance(message, Hello):
            self._hello(identity, message)
        elif isinstance(message, (Fetch, Fetches)):
            now = time.monotonic()
            for fetch in inner or (message,):  # a batch: each answered as if it came alone
                if problem := self._handshakes.fetch(identity, fetch):
                    self._reject(identity, problem, fetch.index)
                else:
                    self._fetch(identity, fetch, now)
        elif isinstance(message, Release):
            self._peers.forget(identity)  # one connection per transfer
            if not self._handshakes.still_read(message.transfer_id):  # (a consumer of more TP ranks: its last)
                if self.engine is not None:
                    self.engine.leases.release(message.transfer_id)
                self._lent.give_back(message.transfer_id)
                self.holds.release(message.transfer_id)
                self._waiting.drop(message.transfer_id)
            if message.answer:
                self._writes.answer_release(identity, message.transfer_id)

    def _hello(self, identity: bytes, hello: Hello) -> None:
        mine = self.layout
        error = ""
        part = rank_part(self.layout.layout, mine.tp_size, hello)  # a decode rank of a larger TP size: its heads
        if hello.tp_size != mine.tp_size and hello.fingerprint != mine.fingerprint and part is None:  # (same heads: any TP)
            error = (f"the decode engine asks for another layout or other KV heads than this rank's "
                     f"(tensor-parallel size {hello.tp_size} there, {mine.tp_size} here)")
        transport, metadata, regions, device, lending = "zmq", b"", (), 0, False
        if not error and self.nixl is not None and "nixl" in hello.transports:
            transport, metadata = "nixl", self.nixl.metadata()
            self._peers.touch(identity)
            self.nixl.bind_device()  # this thread reaches peers and posts WRITEs: cuda_ipc needs the device
            if hello.nixl:  # the peer may be written to (push): reach its agent now
                try:
                    self._peers.reach(identity, hello.nixl)
                except Exception as exc:  # bad metadata, UCX cannot reach it: the peer READs instead
                    logger.warning("kvtier P/D chunk server: cannot reach a decode engine's NIXL agent (%s); "
                                   "it reads the chunks itself.", exc)
            regions, device, lending = self._hbm.hello(identity, hello, hello.fingerprint == mine.fingerprint,
                                                       self._peers.writer(identity))
        else:
            self._peers.over_zmq(identity)
        self._peers.greeted(identity, producer_route(nixl=transport == "nixl", regions=bool(regions),
                                                     writable=self._peers.writer(identity) is not None), part)
        num_blocks = self.engine.num_blocks if self.engine is not None else 0
        fingerprint = mine.fingerprint if part is None else part.fingerprint  # what its chunks are sealed under
        self._send(identity, HelloReply(VERSION, fingerprint, mine.description, mine.chunk_tokens, mine.tp_size,
                                        error, transport, metadata, regions, device, lending, num_blocks, hello.nonce))
        for fetch in self._hbm.carried(hello) if lending else ():  # a pull's first fetches: answered now
            self._fetch(identity, fetch, time.monotonic())  # (not lending: dropped, D sends them again)

    def _fetch(self, identity: bytes, fetch: Fetch, now: float) -> bool:
        """Answer ``fetch`` now if possible; else park it. Returns True once answered."""
        if self._peers.route(identity).hbm and self._hbm.answer_early(identity, fetch):  # from its blocks, checksum taken as its step ended:
            self.served_total += 1  # no look-up in the store (its copy there may be coming, stored, or lost)
            self._peers.touch(identity)
            return True
        if now + EXPECT_S > time.monotonic() and self._hbm.waits_for_lease(identity, fetch):
            self._lease_wait = True
            return self._park(identity, fetch, now)
        skey = storage_key(fetch.key, self.layout.fingerprint)
        buffer = self.store.get(skey)
        if buffer is not None:
            return self._answer(identity, fetch, buffer)
        state = self.holds.state(fetch.transfer_id, skey)
        if state == "pinned" and (buffer := self.store.get(skey)) is not None:  # stored since the look-up above
            return self._answer(identity, fetch, buffer)
        coming = self._saving(skey) or state == "coming" or (state == "unknown" and fetch.wait)
        if not coming:
            self._send(identity, ChunkReply(VERSION, fetch.index, "missing"))
            return True
        return self._park(identity, fetch, now)

    def _retry(self, identity: bytes, fetch: Fetch) -> None:
        """A chunk WRITTEN before it was stored, whose WRITE failed: answer it from the stored copy."""
        self._park(identity, fetch, time.monotonic())
        self.holds.changed.set()

    def _park(self, identity: bytes, fetch: Fetch, now: float) -> bool:
        """Keep ``fetch`` to answer later (False), or refuse it when too many wait (True)."""
        if self._waiting.park(identity, fetch, now, storage_key(fetch.key, self.layout.fingerprint)):
            return False
        self._send(identity, ChunkReply(VERSION, fetch.index, "refused", "too many waiting fetches"))
        return True

    def _answer(self, identity: bytes, fetch: Fetch, buffer: ChunkBuffer) -> bool:
        """Serve a stored chunk as its route has it (takes ``buffer``): from the engine's blocks (HBM routes),
        WRITTEN into the buffer the fetch named (routes that write), lent (NIXL), or sent (ZMQ)."""
        if fetch.tokens and self.layout.token_bytes:
            buffer = recut(self.store, buffer, fetch, self.layout.token_bytes)
            if buffer is None:
                self._send(identity, ChunkReply(VERSION, fetch.index, "missing"))
                return True
        if (part := self._peers.slice_of(identity)) is not None:
            skey = storage_key(fetch.key, self.layout.fingerprint)
            buffer = self._cutter.cut(buffer, skey, self.layout.layout, part,
                                      f"stored chunk {skey.hex()} (chunk {fetch.index} of transfer {fetch.transfer_id})")
            if buffer is None:
                self._send(identity, ChunkReply(VERSION, fetch.index, "missing"))
                return True
        self.served_total += 1
        route = self._peers.route(identity)  # ZMQ once its NIXL peer is dropped
        if route.hbm and self._hbm.answer(identity, fetch, buffer):
            self._peers.touch(identity)
            return True
        if route.writes and fetch.address and fetch.capacity == buffer.data.numel():
            self._writes.start(self.nixl, self._peers.writer(identity), identity, fetch, buffer)
            self._peers.touch(identity)
            return True
        if route.nixl and self.nixl.covers(buffer.data.data_ptr(), buffer.data.numel()):
            self._lent.lend(identity, fetch, buffer)
            self._peers.touch(identity)
            return True
        self._send(identity, ChunkReply(VERSION, fetch.index, "ok"), chunk=buffer)
        return True

    def _expire_lent(self, now: float) -> None:
        self._peers.expire(now, self._lend_s)
        if self.nixl is not None:
            self.nixl.forget_idle(PEER_IDLE_S)
        self._lent.expire(now)
        self._cutter.expire()

    @property
    def engine(self) -> EngineBlocks | None:
        """This rank's engine KV as NIXL has it (set once registered; None: no HBM to HBM)."""
        return self._hbm.engine

    @engine.setter
    def engine(self, engine: EngineBlocks | None) -> None:
        self._hbm.engine = engine

    @property
    def hbm_total(self) -> int:
        """Chunks answered with engine blocks to READ (pull) since start (tests, stats)."""
        return self._hbm.lent_total

    @property
    def lease_waits(self) -> int:
        """Looks at fetches that found their transfer's lease not begun yet (tests, stats)."""
        return self._hbm.lease_waits

    @property
    def written_total(self) -> int:
        """Chunks written into NIXL peers' buffers since start (tests, stats)."""
        return self._writes.written_total

    @property
    def blocks_written_total(self) -> int:
        """Chunks written from engine blocks into push consumers' engine blocks since start."""
        return self._writes.blocks_total

    @property
    def writes_failed_total(self) -> int:
        """Chunks whose WRITE into a NIXL peer failed since start (each sent from its stored copy)."""
        return self._writes.failed_total

    @property
    def cut_total(self) -> int:
        """Chunks answered with a decode rank's part of their heads since start (of ``served_total``)."""
        return self._cutter.total

    @property
    def cut_s(self) -> float:
        """Seconds this server's thread spent cutting chunks to decode ranks' heads since start."""
        return self._cutter.seconds

    @property
    def writes_abandoned_total(self) -> int:
        """Chunks whose WRITE into a NIXL peer ran past its deadline since start (each sent as for a failed one)."""
        return self._writes.abandoned_total

    @property
    def lent_total(self) -> int:
        """Chunks of the CPU tier lent over NIXL since start (tests, stats)."""
        return self._lent.total

    @property
    def lent_chunks(self) -> int:
        """Chunks lent to NIXL peers right now (tests, stats)."""
        return self._lent.count

    @property
    def sending_chunks(self) -> int:
        """Chunks sent over ZMQ whose buffers it still reads right now (tests, stats)."""
        return self._sent.count

    def _serve_waiting(self, now: float, came: set[bytes]) -> None:
        """Answer waiting fetches that may be answerable now: all once anything else changed (an
        announcement, a lease, once a second), else those :meth:`WaitingFetches.take` picks."""
        stored, everything = self.holds.take_stored(), self.holds.changed.is_set()
        if not self._waiting or not (everything or stored or came):
            return
        if everything:  # cleared only when seen: a change after is_set() is looked at next turn
            self.holds.changed.clear()
        for w in self._waiting.take(everything, stored, came):
            self._fetch(w.identity, w.fetch, w.since_s)  # parks it again if still not there
        self._waiting.expire(now, 10 * self._active_s)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        for identity in self._waiting.peers(lambda transfer_id: self.holds.active(transfer_id, self._active_s)):
            self._send(identity, ChunkReply(VERSION, -1, "pending"))
            self._peers.touch_if_nixl(identity, now)  # waiting through a long prefill is not going quiet

    def _send(self, identity: bytes, reply: msgspec.Struct, payload: memoryview | None = None,
              out_of_band: bool = False, chunk: ChunkBuffer | None = None) -> None:
        """Send ``reply``, its MAC covering ``payload`` too. The payload follows as a frame (copied),
        unless it travels ``out_of_band`` (NIXL: the peer reads it, or it was written into the peer's
        buffer). ``chunk``: a chunk's buffer (taken) whose bytes follow as the payload without a copy,
        the buffer kept until ZMQ let go of them (:class:`SentBuffers`)."""
        try:
            if chunk is not None:
                payload, out_of_band = memoryview(chunk.data.numpy()), False
            body = encode(reply)
            frames = [identity, mac(self._secret, body, payload), body]
            if payload is not None and not out_of_band:
                frames.append(payload)
            tracker = self._socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=chunk is None, track=chunk is not None)
            self.sent_total += 1
            if chunk is not None:
                self._sent.add(tracker, chunk)
                chunk = None
        except zmq.Again:  # the peer stopped reading: it times out and recomputes
            self.dropped += 1
            if self.dropped % _LOG_EVERY == 1:
                logger.warning("kvtier P/D chunk server: a decode engine's queue of %d replies is full; a reply was "
                               "dropped (%d so far).", _SEND_HWM, self.dropped)
        except zmq.ZMQError:
            pass  # the peer is gone: it times out and recomputes
        finally:
            if chunk is not None:  # not queued: ZMQ holds none of it
                chunk.release()

    def _reject(self, identity: bytes, why: str, index: int = -1) -> None:
        """Refuse a message (``index``: the chunk a refused fetch asked for, else -1)."""
        self.rejected += 1
        if self.rejected % _LOG_EVERY == 1:
            logger.warning("kvtier P/D chunk server: rejected a message from %s (%s); %d rejected so far.",
                           self._from, why, self.rejected)
        self._send(identity, ChunkReply(VERSION, index, "refused", why[:200]))

    def close(self) -> None:
        """Stop serving and release the socket (idempotent)."""
        self._stop.set()
        self._thread.join(timeout=5)
