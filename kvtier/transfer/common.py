"""What the load side and the save side share: counters, the copy backend's functions, the load cost.

Ownership, one :class:`~kvtier.transfer.TierWorker` each:

* :class:`TransferStats`: one object for both sides. Loads count on the thread that runs them,
  taking no lock; saves count under the save side's lock.
* :class:`Copies`: the copy functions of the worker's ops backend, picked once. The save side
  copies out with ``gather`` / ``gather_async``, the load side in with ``scatter`` / ``scatter_async``.
* :class:`LoadCost`: per-tier ms to load one chunk, written by the threads that run loads, read
  from any thread (the lookup server's, which offers it to the scheduler).
* :func:`on_device`: what each of the worker's own threads runs first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from kvtier.jobs import Landed, LoadJob
from kvtier.layout import Layout
from kvtier.ops import checksums_in_kernel, copies_in_background, pick_backend
from kvtier.storage import ChunkBuffer

if TYPE_CHECKING:  # a type only: kvtier.pd's consumer imports nothing of this package
    from kvtier.pd.consumer.gather import Gathered, Joined

HeldChanged = Callable[[list[bytes]], None]  # storage keys this worker stored, re-confirmed or promoted
# (job, [(chain key, blocks)] of its producer's chunks, per chunk the engine blocks it may be
# written into directly or None) -> those chunks in order, each in a buffer the caller owns or,
# when it was written into the engine blocks named, a Landed (a buffer joined here from another TP size's
# pieces comes wrapped as kvtier.pd.consumer.gather.Joined, the pieces themselves as its Gathered); raises
# kvtier.pd.consumer.hello.PeerError (after yielding what arrived) when the producer fails.
Targets = list[tuple[int, ...] | None]
FetchRemote = Callable[[LoadJob, list[tuple[bytes, int]], Targets],
                       Iterator["ChunkBuffer | Landed | Joined | Gathered"]]
_EWMA = 0.2  # weight of the newest sample in the per-tier load cost


@dataclass(slots=True)
class TransferStats:
    """Counters since start (tokens, KV payload bytes, milliseconds). Loads are counted on the load thread,
    saves under the save side's lock; readers may see a snapshot a step old."""

    loaded_chunks: int = 0
    loaded_bytes: int = 0
    load_ms: float = 0.0
    failed_chunks: int = 0
    cpu_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    remote_hit_tokens: int = 0  # from a P/D producer
    landed_bytes: int = 0  # of those, bytes the producer wrote straight into engine blocks (HBM to HBM)
    shared_hit_tokens: int = 0  # from the shared Redis/Valkey tier
    saved_chunks: int = 0
    saved_bytes: int = 0
    save_ms: float = 0.0
    skipped_saves: int = 0
    dropped_saves: int = 0
    # Where kvtier made the engine wait (CUDA; engine thread): steps whose stream waited for a save
    # still reading blocks they were given, and saves that held the engine thread until their
    # step's forward ended because the save backlog was full (and for how long, ms).
    reuse_waits: int = 0
    backlog_waits: int = 0
    backlog_wait_ms: float = 0.0

    def hit(self, tokens: dict[str, int]) -> None:
        """Count a load's tokens per tier (``cpu``, ``disk``, ``remote``, ``shared``)."""
        self.cpu_hit_tokens += tokens["cpu"]
        self.disk_hit_tokens += tokens["disk"]
        self.remote_hit_tokens += tokens["remote"]
        self.shared_hit_tokens += tokens["shared"]


@dataclass(slots=True)
class Copies:
    """The copy functions of ops backend ``name`` for one layout (:func:`kvtier.ops.pick_backend`).

    ``gather_async`` / ``scatter_async``: the backend's copies that run on after the call returns
    (``dma``), else None. ``kernel_sums``: the copies compute and check the KVSUM64 chunk checksum;
    else a separate pass on the host does. Each side keeps its own half when it is built.
    """

    gather: Callable
    scatter: Callable
    gather_async: Callable | None
    scatter_async: Callable | None
    kernel_sums: bool

    @classmethod
    def of(cls, layout: Layout, name: str) -> Copies:
        gather, scatter = pick_backend(layout, name)
        gather_async, scatter_async = copies_in_background(name) or (None, None)
        return cls(gather, scatter, gather_async, scatter_async, checksums_in_kernel(name))


class LoadCost:
    """Measured ms to load one whole chunk from each tier, as moving averages: fetching and
    verifying it (per tier) plus scattering it (the same for every tier). Written by the threads
    that run loads; read from any thread."""

    def __init__(self):
        self._fetch_ms: dict[str, float] = {}  # tier -> EWMA ms to fetch and verify one chunk
        self._scatter_ms = 0.0  # EWMA ms to scatter one whole chunk
        self._seeded: set[str] = set()  # tiers whose figure is still the probe's, until a load replaces it
        self._probed: frozenset[str] = frozenset()  # tiers whose figure started from a measured read speed

    def seed(self, tier: str, ms: float) -> None:
        """Before any load: ``tier`` fetches one chunk in ``ms`` (its device's read speed, measured
        at start). The first chunk a load really fetches from it replaces the figure; later ones
        refine it as for any tier."""
        self._fetch_ms[tier] = ms
        self._seeded.add(tier)
        self._probed |= {tier}

    def fetched(self, tier: str, ms: float) -> None:
        old = None if tier in self._seeded else self._fetch_ms.get(tier)
        self._seeded.discard(tier)
        self._fetch_ms[tier] = ms if old is None else old + _EWMA * (ms - old)

    def probed(self) -> list[str]:
        """Tiers whose figure started from a read speed measured at start (see :meth:`seed`),
        then refined by loads. Safe from any thread."""
        return sorted(self._probed)

    def scattered(self, per_chunk: float) -> None:
        old = self._scatter_ms
        self._scatter_ms = per_chunk if old == 0 else old + _EWMA * (per_chunk - old)

    def chunk_load_ms(self) -> dict[str, float]:
        """Per tier, ms to fetch, verify and scatter one whole chunk; a tier appears once a load
        has used it. Safe from any thread."""
        fetch = dict(self._fetch_ms)
        return {tier: ms + self._scatter_ms for tier, ms in fetch.items()}


def now_ms() -> float:
    return time.perf_counter() * 1e3


def on_device(device: torch.device) -> Callable[[], None]:
    """A thread's first call: make ``device`` its CUDA device (no-op elsewhere). A thread starts on
    device 0: any CUDA call there from the process of TP rank 1 or above would create a context,
    and take memory, on another rank's GPU."""
    def enter() -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
    return enter


@dataclass(frozen=True, slots=True)
class Copied:
    """A scatter that already ran: ``wait()`` gives its ``ok`` per span."""

    ok: list[bool]

    def wait(self) -> list[bool]:
        return self.ok
