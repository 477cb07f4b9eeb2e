"""The decode-engine connections a chunk server knows, by ZMQ identity (one connection per transfer
and decode rank): the route its hello settled, the KV heads it takes (a decode rank of a larger TP
size), when it last asked anything over NIXL, and the NIXL peer of a consumer that offered buffers
to WRITE into. The server's thread alone reads and writes them (:mod:`kvtier.pd.producer.server`).

A connection is forgotten whole: on its release, or once a NIXL connection has asked nothing for the
server's lending time (a consumer that died sends no release), its engine-block WRITEs not posted
yet included (:class:`~kvtier.pd.producer.hbm_serve.HbmServing`).
"""

from __future__ import annotations

import time
from typing import Callable

from kvtier.pd.nixl import Agent
from kvtier.pd.producer.hbm_serve import HbmServing
from kvtier.pd.producer.slicing import HeadSlice
from kvtier.pd.route import Route


class Peers:
    """What a chunk server knows of each decode connection. ``nixl()``: the server's agent now (None:
    ZMQ only; it may come up after the server started); ``hbm``: its engine-block serving, told when
    a connection is forgotten."""

    def __init__(self, nixl: Callable[[], Agent | None], hbm: HbmServing):
        self._nixl = nixl
        self._hbm = hbm
        self._last: dict[bytes, float] = {}  # connections that chose NIXL -> last message (monotonic s)
        self._writers: dict[bytes, str] = {}  # connections that offered buffers to WRITE into -> NIXL peer name
        self._routes: dict[bytes, Route] = {}  # connection -> its transfer's route, settled by its hello (else ZMQ)
        self._slices: dict[bytes, HeadSlice] = {}  # connection -> the heads a decode rank of a larger TP size takes

    @property
    def over_nixl(self) -> bool:
        """Whether any connection speaks NIXL now (the server's thread then lets NIXL progress)."""
        return bool(self._last)

    def route(self, identity: bytes) -> Route:
        """The route ``identity``'s hello settled (ZMQ once its NIXL side is dropped, or before any hello)."""
        return self._routes.get(identity, Route.ZMQ)

    def slice_of(self, identity: bytes) -> HeadSlice | None:
        """The heads ``identity`` takes of this rank's, cut out for it; None: every head this rank holds."""
        return self._slices.get(identity)

    def writer(self, identity: bytes) -> str | None:
        """The NIXL peer of ``identity``'s consumer, where it offered buffers to WRITE into; else None."""
        return self._writers.get(identity)

    def greeted(self, identity: bytes, route: Route, part: HeadSlice | None) -> None:
        """``identity``'s hello settled ``route`` and the heads it takes (``part``, None: all of them)."""
        self._routes[identity] = route
        if part is not None:
            self._slices[identity] = part
        else:
            self._slices.pop(identity, None)

    def over_zmq(self, identity: bytes) -> None:
        """``identity`` chose ZMQ: it is no NIXL connection (its engine-block serving dropped)."""
        self._last.pop(identity, None)
        self._hbm.forget(identity)

    def reach(self, identity: bytes, metadata: bytes) -> None:
        """Reach ``identity``'s consumer's NIXL agent (its hello's ``metadata``) to WRITE into it. Raises
        what the agent raises (bad metadata, UCX cannot reach it)."""
        self._writers[identity] = self._nixl().connect(metadata, identity)

    def touch(self, identity: bytes) -> None:
        """``identity`` asked or was answered over NIXL just now: not idle."""
        self._last[identity] = time.monotonic()

    def touch_if_nixl(self, identity: bytes, now: float) -> None:
        """As :meth:`touch`, for a connection already known to speak NIXL (a heartbeat while it waits)."""
        if identity in self._last:
            self._last[identity] = now

    def forget(self, identity: bytes) -> None:
        """Forget ``identity`` whole: its route, heads and NIXL side (its WRITEs not posted yet never are)."""
        self._last.pop(identity, None)
        self._routes.pop(identity, None)
        self._slices.pop(identity, None)
        self._hbm.forget(identity)
        if (name := self._writers.pop(identity, None)) is not None:
            self._nixl().disconnect(name, identity)

    def expire(self, now: float, idle_s: float) -> None:
        """Forget the NIXL connections that asked nothing for ``idle_s``."""
        for identity in [i for i, last_s in self._last.items() if now - last_s > idle_s]:
            self.forget(identity)
