"""Chunk buffers a ZMQ reply still reads (see :mod:`kvtier.pd.producer.server`).

A chunk sent over ZMQ goes out without a copy: ZMQ's I/O thread reads the payload straight from
the chunk's buffer (CPU-tier memory, or a cut made for one decode rank) while the server's
thread goes on. The buffer is kept, so LMCache neither evicts nor reuses that memory, until
ZMQ let go of the message (its :class:`zmq.MessageTracker` is done: sent, or dropped with its
peer), and only then released. Used by the chunk server's thread only.
"""

from __future__ import annotations

import time

import zmq

from kvtier.storage import ChunkBuffer

CLOSE_WAIT_S = 1.0  # at close, how long the messages ZMQ still holds get to be dropped


class SentBuffers:
    """Buffers of replies ZMQ has not let go of yet, each beside its tracker."""

    def __init__(self):
        self._out: list[tuple[zmq.MessageTracker, ChunkBuffer]] = []
        self.total = 0  # chunks sent without a copy since start

    def add(self, tracker: zmq.MessageTracker, buffer: ChunkBuffer) -> None:
        """Keep ``buffer`` (taken) until ``tracker`` is done."""
        self._out.append((tracker, buffer))
        self.total += 1

    def release_done(self) -> None:
        """Release the buffers of every message ZMQ let go of."""
        if self._out:
            kept = []
            for tracker, buffer in self._out:
                if tracker.done:
                    buffer.release()
                else:
                    kept.append((tracker, buffer))
            self._out = kept

    def close(self) -> None:
        """After the socket closed (its unsent messages dropped): release what ZMQ let go of within
        :data:`CLOSE_WAIT_S`. A buffer still read then stays taken; the CPU tier's pool goes with the store."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        while self._out and time.monotonic() < deadline:
            self.release_done()
            if self._out:
                time.sleep(0.01)
        self.release_done()

    @property
    def count(self) -> int:
        """Buffers ZMQ still reads."""
        return len(self._out)
