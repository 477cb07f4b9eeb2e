"""For tests: NIXL transfers held in flight past their deadlines, so that a test runs the real
failure (a READ or WRITE that does not end) through real NIXL, not a failed state patched in.

Off by default: with no :class:`Hold` set, :func:`held` is one look at an empty list per posted
transfer, and :meth:`kvtier.pd.nixl.Transfer.state` one attribute look more.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

_POLL_S = 0.002  # how often a transfer posted late looks whether it was let go
_HOLDS: list[Hold] = []  # set now, newest last


class Hold:
    """Hold the transfers that ``match(op, peer, local)`` picks (``op`` "READ" or "WRITE", ``peer``
    the NIXL peer's name, ``local`` this side's ``(address, bytes)`` list), posted from now on, in
    flight until :meth:`let_go`: their state says ``PROC`` while NIXL runs them underneath (on one
    host their bytes move as they are posted). ``late``: their posting waits too (on a poster
    thread: not a WRITE of engine blocks, which the caller's thread posts), so their bytes move when
    let go, as a late transfer's would, or never once their agent removed that peer. ``teardown``:
    the agent removing the peer (:meth:`~kvtier.pd.nixl.Agent.forget`) lets them go too, their
    state NIXL's from then on. A context manager: set on entry, let go and unset on exit.
    ``transfers``: the :class:`~kvtier.pd.nixl.Transfer` objects held so far."""

    def __init__(self, match: Callable[[str, str, list[tuple[int, int]]], bool], late: bool = False,
                 teardown: bool = False):
        self.match, self.late, self.teardown = match, late, teardown
        self.transfers: list = []  # kvtier.pd.nixl.Transfer (not imported: nixl imports this module)
        self.removed: set[tuple[str, str]] = set()  # (agent name, peer name): peers removed while set
        self._gone = threading.Event()

    def holds(self, agent: str, peer: str) -> bool:
        """Whether agent ``agent``'s transfers with ``peer`` are still held."""
        return not self._gone.is_set() and not (self.teardown and (agent, peer) in self.removed)

    def post_late(self, agent: str, peer: str) -> None:
        """On the posting thread: with ``late``, wait until the transfer is let go."""
        while self.late and self.holds(agent, peer):
            time.sleep(_POLL_S)

    def let_go(self) -> None:
        self._gone.set()

    def __enter__(self) -> Hold:
        _HOLDS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.let_go()
        _HOLDS.remove(self)


def held(op: str, peer: str, local: list[tuple[int, int]]) -> Hold | None:
    """The hold that picks this transfer (arguments as :class:`Hold`'s ``match``), if any."""
    return next((h for h in reversed(_HOLDS) if h.match(op, peer, local)), None) if _HOLDS else None


def removed(agent, peer: str) -> None:
    """``agent`` (a :class:`~kvtier.pd.nixl.Agent`) removed NIXL peer ``peer``."""
    for hold in _HOLDS:
        hold.removed.add((agent.name, peer))
