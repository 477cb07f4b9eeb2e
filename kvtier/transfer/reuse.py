"""When the engine may reuse the blocks a save reads (CUDA): the engine thread's bookkeeping of
save reads, shared by the save side (which records them) and the load side (whose copies wait
for them)."""

from __future__ import annotations

from collections import deque
from typing import Iterable

import torch


class ReuseGuard:
    """When the engine may reuse blocks a save reads (CUDA). Without ``defer``, the engine's stream
    waits for every save's reads. With ``defer``, it waits only in :meth:`guard`, for a step given
    a block a save may still be reading. Engine thread only, but for :attr:`reuse_after`, which
    the load threads read."""

    def __init__(self, device: torch.device, defer: bool):
        self.device = device
        self.defer = defer
        # Saves whose engine blocks may still be unread: (event after which they are read, block
        # ids, the device tensor of those ids), oldest first.
        self._unread: deque[tuple[torch.cuda.Event, frozenset[int], torch.Tensor]] = deque()
        self._last_read: torch.cuda.Event | None = None
        self.reuse_after: torch.cuda.Event | None = None  # loads wait for it: their blocks may be being read

    def blocks_read(self, engine: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        """A later step may reuse the blocks a save reads only once ``event`` has passed: the
        engine's stream waits for it now, or (``defer``) :meth:`guard` makes it wait only for a
        step that was given one of those blocks."""
        if self.defer:
            self._last_read = event
        else:
            engine.wait_event(event)

    def saved(self, blocks: Iterable[int], ids: torch.Tensor) -> None:
        """A save has started its copies from engine blocks ``blocks`` (device tensor ``ids``)."""
        if self.defer and self._last_read is not None:
            # ``ids`` too stays alive until the blocks are read: the copies read it on their own
            # stream, and freed now its memory could go to the engine's next kernels first.
            self._unread.append((self._last_read, frozenset(blocks), ids))
            self._last_read = None  # this save's: a later save that starts no copy records nothing

    def guard(self, allocated) -> bool:
        """Before a step's kernels (engine thread): if any of ``allocated`` (engine block ids the
        step was given) is a block an earlier save may still be reading, the engine's stream and
        later loads wait until it has been read; whether they had to. Cheap when nothing overlaps,
        which is the rule: blocks of running requests are never reallocated, only those of
        finished or preempted ones."""
        unread = self._unread
        while unread and unread[0][0].query():
            unread.popleft()
        if not unread or not allocated:
            return False
        wanted = set(allocated)
        for event, blocks, _ in reversed(unread):  # the newest overlapping save; events are in stream order
            if not blocks.isdisjoint(wanted):
                torch.cuda.current_stream(self.device).wait_event(event)
                self.reuse_after = event
                return True
        return False
