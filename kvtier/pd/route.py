"""A P/D transfer's route and stages: how its chunks travel, settled once at the handshake.

Both engines decide the route with :func:`decide_route` from the handshake's facts: whether NIXL
was agreed on (both sides have an agent, P's reply says ``nixl``), whether both sides' engine KV
can meet (D offered engine blocks to land in, P gave its regions), whether D asked before P
computed (push) and D's ``pd_hbm_push``. P sees the same decision from its side
(:func:`producer_route`): D hands over its NIXL metadata only where it decided to be written into.
D's fetch loop (:mod:`kvtier.pd.consumer.fetch`) and P's answer to a fetch
(:meth:`kvtier.pd.producer.server.ChunkServer._answer`) dispatch on the :class:`Route`; no other
module reads the mode settings (``tests/pd/test_route.py`` checks so).

A chunk may still come otherwise than its route says: one P cannot serve from its engine blocks
(no lease, its copy only stored) comes over the CPU tiers, and an HBM path found emulated by the
first READs sends the transfer's remaining chunks through the CPU tiers.

D's transfer goes through the :class:`Stage` values by the methods of :class:`Course`, each of
which refuses (:class:`IllegalTransition`) a step its stage does not allow::

    ARRIVED ──answered──► HANDSHAKEN ──posted──► POSTED ──landed──► LANDED ──released──► RELEASED
     ▲   │                  ▲     │                ▲    │                                   ▲
     └───┘                  └─────┘                └────┘                                   │
     answered again after   judged: the HBM path   posted again, replied (P's turn,         │
     a push's second hello  direct, else over the  whether it lends its blocks)             │
     (D is written into)    CPU tiers                                                       │
    ARRIVED, HANDSHAKEN or POSTED ──failed──► FAILED ──released─────────────────────────────┘
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.pd.protocol import ChunkReply

WINDOW = 4  # fetches in flight per transfer (each holds a CPU-tier buffer)
HBM_WINDOW = 16  # ... when chunks may land in the engine's blocks: no buffer held, more READs in flight
LENT_WINDOW = PUSH_WINDOW = 256  # ... once P lends its blocks or writes into ours: the rest asked at once (64k)


class PushMode(enum.Enum):
    """``pd_hbm_push``: how a decode engine that asked first (push) gets chunks HBM to HBM."""

    READ = "read"  # it READs each from P's blocks once computed
    WRITE = "write"  # P WRITEs each into the blocks its fetch named


class Route(enum.Enum):
    """How one transfer's chunks travel from P to D."""

    ZMQ = "zmq"  # as ZMQ frames (no NIXL on one side, or pd_transport "zmq")
    CPU_READ = "cpu read"  # P lends CPU-tier buffers over NIXL; D READs each into a buffer of its CPU tier
    CPU_WRITE = "cpu write"  # push: each fetch names a buffer of D's CPU tier; P WRITEs the chunk there
    HBM_READ = "hbm read"  # P names its engine blocks (lease or running request); D READs them into its own
    HBM_WRITE = "hbm write"  # push "write": P WRITEs from its engine blocks into those each fetch names

    @property
    def nixl(self) -> bool:
        """Chunks move by NIXL READs or WRITEs, not as ZMQ frames."""
        return self is not Route.ZMQ

    @property
    def hbm(self) -> bool:
        """Chunks land in D's engine blocks (where P serves them from its own)."""
        return self in (Route.HBM_READ, Route.HBM_WRITE)

    @property
    def writes(self) -> bool:
        """P WRITEs into D's memory: D lets NIXL progress while it waits, and D's release waits for
        P's word that no WRITE still runs."""
        return self in (Route.CPU_WRITE, Route.HBM_WRITE)

    def over_cpu(self) -> Route:
        """The same direction through the CPU tiers (an HBM path judged emulated)."""
        return {Route.HBM_READ: Route.CPU_READ, Route.HBM_WRITE: Route.CPU_WRITE}.get(self, self)


def decide_route(*, nixl: bool, hbm: bool, push: bool, push_mode: PushMode) -> Route:
    """The route of a transfer. ``nixl``: both sides have an agent and P's reply agreed on NIXL.
    ``hbm``: D offered engine blocks to land in and P gave its engine KV regions. ``push``: D asked
    before P computed the chunks. ``push_mode``: D's ``pd_hbm_push``. A push is written into D,
    unless D READs P's blocks ("read", both sides' engine KV known)."""
    if not nixl:
        return Route.ZMQ
    writes = push and not (hbm and push_mode is PushMode.READ)
    if hbm:
        return Route.HBM_WRITE if writes else Route.HBM_READ
    return Route.CPU_WRITE if writes else Route.CPU_READ


def producer_route(*, nixl: bool, regions: bool, writable: bool) -> Route:
    """The route as P sees it from a hello: ``nixl`` agreed on, ``regions`` (its engine KV) given to
    D, and ``writable``: D gave its NIXL metadata (which it does only where :func:`decide_route`
    had it written into) and this agent reached D's."""
    return decide_route(nixl=nixl, hbm=regions, push=writable, push_mode=PushMode.WRITE)


class Stage(enum.Enum):
    """Where D's side of one transfer stands."""

    ARRIVED = "arrived"  # connected, a hello sent; P's reply not checked yet
    HANDSHAKEN = "handshaken"  # P's reply checked: the route settled
    POSTED = "posted"  # fetches (and NIXL READs) in flight
    LANDED = "landed"  # every chunk handed to the caller: in its engine blocks (KVSUM64 checked by
    # kvtier.transfer.landed) or in a CPU-tier buffer whose MAC was checked
    RELEASED = "released"  # Release sent: P's lease, lent buffers and holds of the transfer end
    FAILED = "failed"  # ended before every chunk was handed out (P silent, refused or gone, a READ
    # failed or missed its deadline, the request aborted, the caller stopped): the caller loads the
    # rest through the CPU tiers or recomputes


class IllegalTransition(RuntimeError):
    """A transfer asked to take a step its stage does not allow (a bug in its caller)."""


@dataclass(slots=True)
class Course:
    """D's side of transfer ``transfer_id`` from ``endpoint``: its stage, its route and what P's
    replies said so far. ``push``: D asked before P computed. ``push_mode``: D's ``pd_hbm_push``.
    ``landing``: D offered engine blocks to land in."""

    transfer_id: str
    endpoint: str
    push: bool
    push_mode: PushMode = PushMode.READ
    landing: bool = False
    stage: Stage = Stage.ARRIVED
    route: Route = Route.ZMQ
    writable: bool = False  # D gave P its NIXL metadata (a second hello): it is written into
    lends_now: bool = False  # P's latest reply named its engine blocks: no buffer held per fetch
    more: int = 0  # replies P sent with its latest, still to come
    nixl_failed: bool = False  # a NIXL transfer with P failed: its agent is forgotten at the end
    silent: bool = False  # P sent nothing for the timeout (dead or hung: no WRITE of its still comes)

    def _step(self, allowed: tuple[Stage, ...], to: Stage) -> None:
        if self.stage not in allowed:
            raise IllegalTransition(f"kvtier P/D: transfer {self.transfer_id} from {self.endpoint} cannot go from "
                                    f"{self.stage.name} to {to.name}")
        self.stage = to

    def answered(self, *, nixl: bool, regions: bool) -> bool:
        """P's checked reply to a hello: settle the route (``nixl``: agreed on; ``regions``: P gave its
        engine KV). True where D must first send its NIXL metadata in a second hello (it is written
        into: the stage stays ARRIVED until that hello's reply)."""
        mode = PushMode.WRITE if self.writable else self.push_mode
        route = decide_route(nixl=nixl, hbm=self.landing and regions, push=self.push or self.writable, push_mode=mode)
        if route.writes and not self.writable:
            self._step((Stage.ARRIVED,), Stage.ARRIVED)
            self.writable = True
            return True
        self._step((Stage.ARRIVED,), Stage.HANDSHAKEN)
        self.route = route
        return False

    def judged(self, direct: bool, lending: bool) -> Route:
        """The HBM path to P judged ``direct`` (else its chunks go through the CPU tiers); ``lending``:
        P's reply says it lends the transfer's blocks now (a pull then asks for them all at once)."""
        self._step((Stage.HANDSHAKEN,), Stage.HANDSHAKEN)
        self.route = self.route if direct else self.route.over_cpu()
        self.lends_now = self.route.hbm and lending and not self.push
        return self.route

    def posted(self) -> None:
        """Fetches went out (again)."""
        self._step((Stage.HANDSHAKEN, Stage.POSTED), Stage.POSTED)

    def replied(self, reply: ChunkReply) -> None:
        """A chunk reply came: how many of its turn follow, and whether P lends its blocks."""
        self._step((Stage.POSTED,), Stage.POSTED)
        self.more = reply.more
        if reply.status == "ok":
            self.lends_now = bool(reply.blocks)

    def window(self) -> int:
        """Fetches to keep in flight."""
        if not self.route.hbm:
            return WINDOW
        return PUSH_WINDOW if self.push else LENT_WINDOW if self.lends_now else HBM_WINDOW

    def asks_rest(self) -> bool:
        """Whether to ask for every chunk left at once and READ them together: P lends a pull's blocks."""
        return self.route.hbm and self.lends_now and not self.push

    def waits_for_turn(self) -> bool:
        """Whether replies of P's current turn are still coming (they are READ as one)."""
        return self.more > 0

    def broke_nixl(self) -> None:
        """A NIXL transfer with P failed."""
        self.nixl_failed = True

    def went_silent(self) -> None:
        """P sent nothing for the timeout."""
        self.silent = True

    def landed(self) -> None:
        """Every chunk was handed to the caller."""
        self._step((Stage.HANDSHAKEN, Stage.POSTED), Stage.LANDED)

    def failed(self) -> None:
        """The transfer ends before every chunk was handed out."""
        self._step((Stage.ARRIVED, Stage.HANDSHAKEN, Stage.POSTED), Stage.FAILED)

    def released(self, named: bool) -> bool:
        """The release goes out; whether it asks P for its word that none of its WRITEs still runs:
        ``named``, engine blocks or buffers were named to P and not answered, unless P went silent."""
        self._step((Stage.LANDED, Stage.FAILED), Stage.RELEASED)
        return named and not self.silent
