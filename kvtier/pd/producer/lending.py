"""A chunk server's CPU-tier buffers lent to NIXL peers (see :mod:`kvtier.pd.producer.server`).

A peer that READs a chunk itself is answered with the chunk's address in the registered CPU
pool; its buffer (a reference to the pool memory, so LMCache neither evicts nor reuses it) is
kept until the peer releases the transfer, or, should the peer vanish, until the transfer was
asked nothing for ``lend_s`` (the peer has given up by then). Used by the chunk server's thread only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from kvtier.pd.protocol import VERSION, ChunkReply, Fetch
from kvtier.storage import ChunkBuffer

logger = logging.getLogger(__name__)
Send = Callable[..., None]  # (identity, reply, payload, out_of_band=...) -> None: the server's _send


@dataclass(slots=True)
class _Lent:
    """Buffers lent to a NIXL peer for one transfer; ``last_s``: its last fetch (monotonic s)."""

    buffers: list[ChunkBuffer]
    last_s: float


class LentBuffers:
    """Lent buffers by transfer id. ``send``: how the server replies; ``lend_s``: see the module docstring."""

    def __init__(self, send: Send, lend_s: float):
        self._send = send
        self.lend_s = lend_s
        self._lent: dict[str, _Lent] = {}
        self.total = 0  # chunks lent since start

    def lend(self, identity: bytes, fetch: Fetch, buffer: ChunkBuffer) -> None:
        """Reply with where the chunk lies; keep its buffer (taken) until the transfer is released."""
        lent = self._lent.setdefault(fetch.transfer_id, _Lent([], time.monotonic()))
        lent.buffers.append(buffer)
        lent.last_s = time.monotonic()
        self.total += 1
        reply = ChunkReply(VERSION, fetch.index, "ok", address=buffer.data.data_ptr(), nbytes=buffer.data.numel())
        self._send(identity, reply, memoryview(buffer.data.numpy()), out_of_band=True)  # if the peer is gone,
        # the buffer goes back when the loan expires

    def give_back(self, transfer_id: str) -> None:
        """The transfer was released: its buffers go back to the CPU tier."""
        lent = self._lent.pop(transfer_id, None)
        for buffer in lent.buffers if lent else ():
            buffer.release()

    def expire(self, now: float) -> None:
        """Give back the buffers of transfers asked nothing for ``lend_s`` (``now``: monotonic s)."""
        for transfer_id in [t for t, lent in self._lent.items() if now - lent.last_s > self.lend_s]:
            logger.info("kvtier P/D chunk server: transfer %s was not released within %.0f s; its %d lent "
                        "chunks go back to the CPU tier.", transfer_id, self.lend_s,
                        len(self._lent[transfer_id].buffers))
            self.give_back(transfer_id)

    def close(self) -> None:
        for transfer_id in list(self._lent):
            self.give_back(transfer_id)

    @property
    def count(self) -> int:
        """Chunks lent right now."""
        return sum(len(lent.buffers) for lent in list(self._lent.values()))
