"""A chunk server's NIXL WRITEs into push consumers' buffers (see :mod:`kvtier.pd.server`).

Each WRITE keeps its chunk's buffer until it no longer runs: on one host the bytes move while it
is posted, with RDMA later. Once done, the consumer is told the chunk is there (``written``); a
WRITE that failed sends the chunk as a payload frame instead, so the consumer still gets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvtier.pd.nixl import Agent, Transfer
from kvtier.pd.protocol import VERSION, ChunkReply, Fetch
from kvtier.storage import ChunkBuffer

Send = Callable[..., None]  # (identity, reply, payload, out_of_band=...) -> None: the server's _send


@dataclass(slots=True)
class _Write:
    """A chunk being written into a NIXL peer's buffer: answered once ``transfer`` is done."""

    identity: bytes
    fetch: Fetch
    buffer: ChunkBuffer
    transfer: Transfer


class PeerWrites:
    """WRITEs in flight. ``send``: how the server replies."""

    def __init__(self, send: Send):
        self._send = send
        self._writes: list[_Write] = []
        self.written_total = 0  # chunks written into NIXL peers' buffers since start

    def __bool__(self) -> bool:
        return bool(self._writes)

    def start(self, agent: Agent, peer: str, identity: bytes, fetch: Fetch, buffer: ChunkBuffer) -> None:
        """WRITE ``buffer`` (taken) into the buffer ``fetch`` named in NIXL peer ``peer``."""
        transfer = agent.write(peer, [(buffer.data.data_ptr(), buffer.data.numel())], [(fetch.address, fetch.capacity)])
        self._writes.append(_Write(identity, fetch, buffer, transfer))
        self.poll()

    def poll(self) -> None:
        """Answer the WRITEs that finished; one that failed sends its chunk as a payload instead."""
        running = []
        for w in self._writes:
            state = w.transfer.state()
            if state == "PROC":
                running.append(w)
                continue
            w.transfer.release()
            try:
                payload = memoryview(w.buffer.data.numpy())
                if state == "DONE":
                    self.written_total += 1
                    reply = ChunkReply(VERSION, w.fetch.index, "ok", nbytes=w.buffer.data.numel(), written=True)
                    self._send(w.identity, reply, payload, out_of_band=True)
                else:
                    self._send(w.identity, ChunkReply(VERSION, w.fetch.index, "ok"), payload)
            finally:
                w.buffer.release()
        self._writes = running

    def settle(self, timeout_s: float) -> None:
        """At close: a buffer goes back only once no WRITE reads it."""
        for w in self._writes:
            if w.transfer.settle(timeout_s):
                w.transfer.release()
                w.buffer.release()
        self._writes = []
