"""A chunk server's NIXL WRITEs into push consumers' memory (see :mod:`kvtier.pd.producer.server`).

Into a consumer's CPU-tier buffer: each WRITE keeps its chunk's buffer until it no longer runs
(posted on the agent's poster threads: on one host the bytes move while it is posted, several
chunks at once, with RDMA later). Once done, the consumer is told the chunk is there
(``written``); a WRITE that failed sends the chunk as a payload frame instead, so the consumer
still gets it.

Into a consumer's engine blocks (HBM push): the chunks that became ready in one turn of the
server go out as one WRITE from this engine's blocks, one descriptor per run of consecutive
blocks and region (:func:`kvtier.pd.hbm.read_descriptors`). Each ``written`` reply carries the
chunk's KVSUM64, which the consumer checks on its GPU; a failed WRITE sends the stored copy
instead (once stored, for a chunk written before it was). The first WRITEs to each consumer are
timed (:func:`kvtier.pd.hbm.read_speed`): an emulated path ends HBM pushes to it.

**Deadlines.** Every WRITE has one: ``timeout_s`` (the server's ``pd_timeout_ms``) after its
posting. A WRITE still running then is abandoned: the consumer's NIXL agent is torn down on this
side (:meth:`Agent.forget <kvtier.pd.nixl.Agent.forget>`, NIXL's ``remove_remote_agent``: this
side can no longer post to it and its connection closes, so nothing more of it lands; the
consumer's next hello adds it afresh), its chunks are sent as payloads as for a failed WRITE,
and it is counted (``abandoned_total``). Its stored copies go back once answered (the agent is
gone by then); NIXL's handle once NIXL no longer runs it. No exception from posting, NIXL's
handles or a reply escapes: the chunks concerned fall back, each buffer is released once.

**Releases.** A consumer that gives up on a push with chunks named to this server asks for an
answer to its release (:meth:`PeerWrites.answer_release`): ``released`` goes once no WRITE of
that transfer runs, at the latest one deadline after its last WRITE was posted (and a poll of
the server's loop, 1 ms while WRITEs run). The consumer waits for it up to twice its own
``pd_timeout_ms`` (:meth:`kvtier.pd.consumer.connection.Connection.settle_writes`) before its load reports and
vLLM recomputes into the blocks: both engines must use the same ``pd_timeout_ms`` (or the
consumer a longer one).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import msgspec

from kvtier.pd.hbm import EngineBlocks, RegionSpan, read_descriptors, read_speed
from kvtier.pd.nixl import Agent, Transfer
from kvtier.pd.protocol import VERSION, ChunkReply, Fetch, reply_batches
from kvtier.storage import ChunkBuffer
from kvtier.timeline import mark

logger = logging.getLogger(__name__)
Send = Callable[..., None]  # (identity, reply, payload, out_of_band=...) -> None: the server's _send
Retry = Callable[[bytes, Fetch], None]  # (identity, fetch): answer it from the stored copy once there


@dataclass(slots=True)
class _Write:
    """A chunk being written into a NIXL peer's memory: answered once ``transfer`` is done.
    ``checksum``: the chunk's KVSUM64 when written from engine blocks (HBM push), else None.
    ``deadline_s``: when it is abandoned if still running (monotonic s)."""

    identity: bytes
    fetch: Fetch
    buffer: ChunkBuffer | None  # the stored copy (None: written before it was stored)
    transfer: Transfer
    deadline_s: float
    checksum: int | None = None
    started_s: float = 0.0  # perf_counter s


@dataclass(frozen=True, slots=True)
class BlockWrite:
    """A chunk to write from this engine's ``blocks`` into those ``fetch`` names (its ``buffer``,
    the stored copy, None when not stored yet, and ``checksum``, its KVSUM64)."""

    identity: bytes
    fetch: Fetch
    buffer: ChunkBuffer | None
    blocks: tuple[int, ...]
    checksum: int


class PeerWrites:
    """WRITEs in flight. ``send``: how the server replies; ``retry``: how it answers a chunk
    whose WRITE failed before its stored copy was there; ``timeout_s``: each WRITE's deadline
    after its posting (the server's ``pd_timeout_ms``, s)."""

    def __init__(self, send: Send, retry: Retry, timeout_s: float):
        self._send = send
        self._retry = retry
        self._timeout_s = timeout_s
        self._writes: list[_Write] = []
        self._abandoned: list[Transfer] = []  # WRITEs given up on whose NIXL handle is not given back yet
        self._releases: list[tuple[bytes, str]] = []  # (identity, transfer id): answer "released" once idle
        self.written_total = 0  # chunks written into NIXL peers' memory since start
        self.blocks_total = 0  # ... of them, from engine blocks into engine blocks
        self.failed_total = 0  # chunks whose WRITE failed (each then sent from its stored copy)
        self.abandoned_total = 0  # chunks whose WRITE ran past its deadline (sent as for a failed one)

    def __bool__(self) -> bool:
        return bool(self._writes)

    def start(self, agent: Agent, peer: str, identity: bytes, fetch: Fetch, buffer: ChunkBuffer) -> None:
        """WRITE ``buffer`` (taken) into the buffer ``fetch`` named in NIXL peer ``peer``."""
        try:
            transfer = agent.write(peer, [(buffer.data.data_ptr(), buffer.data.numel())],
                                   [(fetch.address, fetch.capacity)])
        except Exception as exc:  # the chunk falls back (poll)
            transfer = Transfer.failed(agent, peer, exc)
        self._writes.append(_Write(identity, fetch, buffer, transfer, time.monotonic() + self._timeout_s))
        self.poll()

    def start_blocks(self, agent: Agent, peer: str, engine: EngineBlocks, theirs: tuple[RegionSpan, ...],
                     device: int, chunks: list[BlockWrite]) -> None:
        """One WRITE of ``chunks`` (their buffers taken) from this engine's blocks into NIXL peer
        ``peer``'s engine KV ``theirs`` on its CUDA device ``device``."""
        begin = time.perf_counter()  # posting runs on this thread: it counts
        try:
            mine_ids, their_ids = [b for c in chunks for b in c.blocks], [b for c in chunks for b in c.fetch.blocks]
            local, remote = read_descriptors(engine.regions, theirs, mine_ids, their_ids)
            transfer = agent.write(peer, local, remote, (engine.kind, engine.device, device))
        except Exception as exc:  # regions are checked at the handshake; the chunks fall back (poll)
            transfer = Transfer.failed(agent, peer, exc)
        deadline_s = time.monotonic() + self._timeout_s
        self._writes += [_Write(c.identity, c.fetch, c.buffer, transfer, deadline_s, c.checksum, begin) for c in chunks]
        self.poll()

    def busy(self, transfer_id: str) -> bool:
        """Whether a WRITE of ``transfer_id`` still runs (abandoned ones do not)."""
        return any(w.fetch.transfer_id == transfer_id for w in self._writes)

    def answer_release(self, identity: bytes, transfer_id: str) -> None:
        """Send ``released`` to ``identity`` once no WRITE of ``transfer_id`` runs: now, or from a :meth:`poll`."""
        self._releases.append((identity, transfer_id))
        self._answer_releases()

    def poll(self) -> None:
        """Answer the WRITEs that finished (those into engine blocks together, per consumer: it checks
        them in one pass); one that failed, or ran past its deadline, sends its chunk as a payload
        instead. Then answer the releases whose transfer has no WRITE running. Never raises."""
        now, running, ended, late = time.monotonic(), [], [], []
        for w in self._writes:
            state = w.transfer.state()
            (running if state == "PROC" and now <= w.deadline_s else late if state == "PROC" else ended).append(w)
        if late:  # counted, and the consumer's agent dropped, before the WRITEs stop showing as busy
            self._abandon(late)
        self._writes = running  # each write below is answered, and its buffer released, once
        landed: dict[bytes, list[ChunkReply]] = {}
        for w in ended + late:
            try:
                self._end(w, w in late, landed)
            except Exception:  # a reply that could not be built or sent: the consumer times out on that chunk
                logger.exception("kvtier P/D chunk server: answering the WRITE of chunk %d of transfer %s failed.",
                                 w.fetch.index, w.fetch.transfer_id)
            finally:
                if w.buffer is not None:
                    w.buffer.release()
        for identity, replies in landed.items():
            for message in reply_batches(replies):
                self._send(identity, message)
        self._give_back_abandoned()
        self._answer_releases()

    def _give_back_abandoned(self) -> None:
        """Give back the NIXL handles of abandoned WRITEs that no longer run."""
        running = []
        for transfer in self._abandoned:
            if transfer.state() == "PROC":
                running.append(transfer)
            else:
                transfer.release()
        self._abandoned = running

    def _end(self, w: _Write, abandoned: bool, landed: dict[bytes, list[ChunkReply]]) -> None:
        """Answer one chunk whose WRITE ended or was ``abandoned``; a WRITE into engine blocks that is
        done joins ``landed`` (identity -> replies)."""
        state = "ABANDONED" if abandoned else w.transfer.state()
        if not abandoned and not w.transfer.released:  # the first of the chunks sharing this WRITE
            self._give_back(w, state)
        if state != "DONE":
            if not abandoned:
                self.failed_total += 1
            self._fall_back(w)
            return
        self.written_total += 1
        if w.checksum is None:
            reply = ChunkReply(VERSION, w.fetch.index, "ok", nbytes=w.buffer.data.numel(), written=True)
            self._send(w.identity, reply, memoryview(w.buffer.data.numpy()), out_of_band=True)
        else:
            self.blocks_total += 1
            landed.setdefault(w.identity, []).append(ChunkReply(
                VERSION, w.fetch.index, "ok", written=True, blocks=w.fetch.blocks, checksum=w.checksum))

    @staticmethod
    def _give_back(w: _Write, state: str) -> None:
        """Give NIXL's handle of a WRITE that ended back, and time it (errors logged: the chunk is answered)."""
        w.transfer.release()
        try:
            if state == "DONE":
                mark(w.fetch.transfer_id, "written")
                if w.checksum is not None:
                    seconds = time.perf_counter() - w.started_s
                    read_speed(w.transfer.peer, "VRAM", w.transfer.nbytes, seconds, "WRITE")
                    logger.debug("kvtier P/D: WRITE of %.0f MiB of engine blocks into %s done %.1f ms after its "
                                 "posting began", w.transfer.nbytes / (1 << 20), w.transfer.peer, seconds * 1e3)
        except Exception:
            logger.exception("kvtier P/D chunk server: timing a WRITE into %s failed.", w.transfer.peer)

    def _abandon(self, late: list[_Write]) -> None:
        """WRITEs past their deadline: each consumer's NIXL agent is torn down on this side (nothing
        more of them can land; its next hello adds it afresh), then their chunks fall back."""
        transfers = list({id(w.transfer): w.transfer for w in late}.values())
        for agent, peer in {(t.agent, t.peer) for t in transfers}:
            logger.warning("kvtier P/D chunk server: a WRITE into decode engine %s did not end in %.1f s; its NIXL "
                           "agent is dropped here and its chunks go as payloads.", peer, self._timeout_s)
            agent.forget(name=peer)
        self.abandoned_total += len(late)
        self._abandoned += transfers

    def _fall_back(self, w: _Write) -> None:
        """A WRITE that failed: the chunk goes as a payload frame, from its stored copy, or once
        that is stored (a fetch without engine blocks, served like any other)."""
        if w.buffer is None:
            self._retry(w.identity, msgspec.structs.replace(w.fetch, hbm=False, blocks=()))
        else:
            self._send(w.identity, ChunkReply(VERSION, w.fetch.index, "ok"), memoryview(w.buffer.data.numpy()))

    def _answer_releases(self) -> None:
        """Answer the releases whose transfer has no WRITE running any more."""
        done = [(i, t) for i, t in self._releases if not self.busy(t)]
        self._releases = [r for r in self._releases if r not in done]
        for identity, _ in done:
            self._send(identity, ChunkReply(VERSION, -1, "released"))

    def settle(self, timeout_s: float) -> None:
        """At close: a buffer goes back only once no WRITE reads it."""
        for w in self._writes:
            if w.transfer.released or w.transfer.settle(timeout_s):
                w.transfer.release()
                if w.buffer is not None:
                    w.buffer.release()
        self._writes = []
        self._give_back_abandoned()
