"""A chunk server's NIXL WRITEs into push consumers' memory (see :mod:`kvtier.pd.server`).

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
    ``checksum``: the chunk's KVSUM64 when written from engine blocks (HBM push), else None."""

    identity: bytes
    fetch: Fetch
    buffer: ChunkBuffer | None  # the stored copy (None: written before it was stored)
    transfer: Transfer
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
    whose WRITE failed before its stored copy was there."""

    def __init__(self, send: Send, retry: Retry):
        self._send = send
        self._retry = retry
        self._writes: list[_Write] = []
        self.written_total = 0  # chunks written into NIXL peers' memory since start
        self.blocks_total = 0  # ... of them, from engine blocks into engine blocks
        self.failed_total = 0  # chunks whose WRITE failed (each then sent from its stored copy)

    def __bool__(self) -> bool:
        return bool(self._writes)

    def start(self, agent: Agent, peer: str, identity: bytes, fetch: Fetch, buffer: ChunkBuffer) -> None:
        """WRITE ``buffer`` (taken) into the buffer ``fetch`` named in NIXL peer ``peer``."""
        transfer = agent.write(peer, [(buffer.data.data_ptr(), buffer.data.numel())], [(fetch.address, fetch.capacity)])
        self._writes.append(_Write(identity, fetch, buffer, transfer))
        self.poll()

    def start_blocks(self, agent: Agent, peer: str, engine: EngineBlocks, theirs: tuple[RegionSpan, ...],
                     device: int, chunks: list[BlockWrite]) -> None:
        """One WRITE of ``chunks`` (their buffers taken) from this engine's blocks into NIXL peer
        ``peer``'s engine KV ``theirs`` on its CUDA device ``device``."""
        mine_ids = [b for c in chunks for b in c.blocks]
        their_ids = [b for c in chunks for b in c.fetch.blocks]
        begin = time.perf_counter()  # posting runs on this thread: it counts
        try:
            local, remote = read_descriptors(engine.regions, theirs, mine_ids, their_ids)
        except ValueError as exc:  # checked at the handshake; a failed WRITE's answer if it happens
            transfer = Transfer.failed(agent, peer, exc)
        else:
            transfer = agent.write(peer, local, remote, (engine.kind, engine.device, device))
        self._writes += [_Write(c.identity, c.fetch, c.buffer, transfer, c.checksum, begin) for c in chunks]
        self.poll()

    def busy(self, transfer_id: str) -> bool:
        """Whether a WRITE of ``transfer_id`` still runs."""
        return any(w.fetch.transfer_id == transfer_id for w in self._writes)

    def poll(self) -> None:
        """Answer the WRITEs that finished (those into engine blocks together, per consumer: it checks
        them in one pass); one that failed sends its chunk as a payload instead."""
        running, landed = [], {}
        for w in self._writes:
            state = w.transfer.state()
            if state == "PROC":
                running.append(w)
                continue
            if not w.transfer.released:  # the first of the chunks sharing this WRITE
                w.transfer.release()
                if state == "DONE":
                    mark(w.fetch.transfer_id, "written")
                    if w.checksum is not None:
                        seconds = time.perf_counter() - w.started_s
                        read_speed(w.transfer.peer, "VRAM", w.transfer.nbytes, seconds, "WRITE")
                        logger.debug("kvtier P/D: WRITE of %.0f MiB of engine blocks into %s done %.1f ms after its "
                                     "posting began", w.transfer.nbytes / (1 << 20), w.transfer.peer, seconds * 1e3)
            try:
                if state != "DONE":
                    self.failed_total += 1
                    self._fall_back(w)
                    continue
                self.written_total += 1
                if w.checksum is None:
                    reply = ChunkReply(VERSION, w.fetch.index, "ok", nbytes=w.buffer.data.numel(), written=True)
                    self._send(w.identity, reply, memoryview(w.buffer.data.numpy()), out_of_band=True)
                else:
                    self.blocks_total += 1
                    landed.setdefault(w.identity, []).append(ChunkReply(
                        VERSION, w.fetch.index, "ok", written=True, blocks=w.fetch.blocks, checksum=w.checksum))
            finally:
                if w.buffer is not None:
                    w.buffer.release()
        self._writes = running
        for identity, replies in landed.items():
            for message in reply_batches(replies):
                self._send(identity, message)

    def _fall_back(self, w: _Write) -> None:
        """A WRITE that failed: the chunk goes as a payload frame, from its stored copy, or once
        that is stored (a fetch without engine blocks, served like any other)."""
        if w.buffer is None:
            self._retry(w.identity, msgspec.structs.replace(w.fetch, hbm=False, blocks=()))
        else:
            self._send(w.identity, ChunkReply(VERSION, w.fetch.index, "ok"), memoryview(w.buffer.data.numpy()))

    def settle(self, timeout_s: float) -> None:
        """At close: a buffer goes back only once no WRITE reads it."""
        for w in self._writes:
            if w.transfer.released or w.transfer.settle(timeout_s):
                if not w.transfer.released:
                    w.transfer.release()
                if w.buffer is not None:
                    w.buffer.release()
        self._writes = []
