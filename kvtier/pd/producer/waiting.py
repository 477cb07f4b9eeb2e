"""The fetches a chunk server keeps until their chunk is there: stored (a save still queued, or
the transfer still being computed: push) or its checksum taken from the engine's blocks.

Each turn of the server looks again only at those that may be answerable now
(:meth:`WaitingFetches.take`): a prompt's chunks come one by one, and looking at every waiting
fetch for each is quadratic Python on the engine's GIL. Used by the chunk server's thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from kvtier.pd.protocol import Fetch

MAX_WAITING = 4096  # fetches kept for chunks still being computed, over all peers


@dataclass(slots=True)
class Waiting:
    """``fetch`` from the connection ``identity``, waiting since ``since_s`` (monotonic s) for the
    chunk of storage key ``skey``."""

    identity: bytes
    fetch: Fetch
    since_s: float
    skey: bytes


class WaitingFetches:
    def __init__(self):
        self._waiting: list[Waiting] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Waiting]:
        return iter(self._waiting)

    def park(self, identity: bytes, fetch: Fetch, now: float, skey: bytes) -> bool:
        """Keep ``fetch`` (once: the same fetch parked again is kept as it was); False when
        :data:`MAX_WAITING` wait already (the caller refuses it)."""
        if any(w.identity == identity and w.fetch == fetch for w in self._waiting):
            return True
        if len(self._waiting) >= MAX_WAITING:
            return False
        self._waiting.append(Waiting(identity, fetch, now, skey))
        return True

    def take(self, everything: bool, stored: set[bytes], came: set[bytes]) -> list[Waiting]:
        """Remove and return those that may be answerable now: all with ``everything``, else
        those whose chunk was ``stored`` (storage keys) or given up, or whose checksum ``came``
        (chain keys)."""
        waiting, self._waiting, again = self._waiting, [], []
        for w in waiting:
            (again if everything or w.skey in stored or w.fetch.key in came else self._waiting).append(w)
        return again

    def drop(self, transfer_id: str) -> None:
        """Forget the fetches of a released transfer."""
        self._waiting = [w for w in self._waiting if w.fetch.transfer_id != transfer_id]

    def expire(self, now: float, horizon_s: float) -> None:
        """Forget those waiting longer than ``horizon_s``: peers that stopped asking (timed out,
        died) must not pin entries forever."""
        self._waiting = [w for w in self._waiting if now - w.since_s <= horizon_s]

    def peers(self, alive: Callable[[str], bool]) -> set[bytes]:
        """The connections waiting for a transfer that is ``alive(transfer id)``."""
        return {w.identity for w in self._waiting if alive(w.fetch.transfer_id)}

    @property
    def pushing(self) -> bool:
        """Whether a fetch waits to be WRITTEN into a consumer's engine blocks."""
        return any(w.fetch.blocks for w in self._waiting)
