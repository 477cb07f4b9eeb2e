"""Load plans: what to do with a prompt whose prefix is stored in kvtier's tiers.

Pure functions of data, engine-agnostic. Positions are in tokens unless a name says blocks or
chunks. The engine's own prefix-cache hit (the *local floor*) is always block-aligned; a stored
hit is always chunk-aligned (only full chunks are keyed), so the two disagree whenever the floor
ends inside a chunk. Four answers:

- ``LOAD``: the floor is chunk-aligned; load whole chunks ``[local, hit)``.
- ``PARTIAL``: load block by block from the chunk holding the floor, starting at the floor's
  block. That chunk is fetched and verified whole, so it costs a full chunk's transfer.
- ``HANDOFF``: prefill ``[local, boundary)`` (the next chunk boundary) first, then load the
  aligned chunks ``[boundary, hit)``. Costs one extra engine step and the gap's prefill.
- ``REMOTE``: a P/D consumer loads everything past the floor, the prompt's last partial block
  included, from its own tiers as far as they hold it and from the producer's tier after that.
  Never vetoed on cost; nothing when the floor is already the engine's whole prompt hit (vLLM
  recomputes the block holding the last prompt token anyway).

``unaligned="auto"`` takes whichever of partial and handoff the cost model predicts sooner: a
handoff saves fetching the floor's chunk but pays one engine step plus the gap's prefill, so it
wins only on slow tiers with a small gap. While costs are unknown, auto is partial.

``NONE`` (recompute) whenever a load would not pay: the hit is below ``min_load_tokens``, it
would write into a block that already holds computed tokens (LMCache #2206 corrupted output
that way), or the cost model says recomputing is faster.

A hit may mix tiers chunk by chunk (CPU first, disk after). Where the cost model has measured
every tier of the hit, a plan may stop at any chunk boundary: of the ends ``e`` from the first
boundary past the load's start to the hit's end, it takes the one that minimizes the load of
``[start, e)`` plus the prefill of ``[e, hit)`` (recompute the rest), so it is never slower by the
model than loading it all or recomputing it all (then ``NONE``, ``Skip.SLOWER``). Where only a
suffix of the hit sits on tiers measured or probed (disk chunks after CPU ones whose tier has no
measured loads yet), a plan may stop at a boundary within that suffix, never before it, and is
never vetoed whole. A cut plan keeps its kind and loads fewer tokens; :attr:`LoadPlan.stored_end`
says where the hit ended.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from kvtier.scheduler_hooks.cost import CostModel

UNALIGNED_MODES = ("partial", "handoff", "auto")


class PlanKind(enum.Enum):
    NONE = "none"
    LOAD = "load"
    PARTIAL = "partial"
    HANDOFF = "handoff"
    REMOTE = "remote"


class Skip(str, enum.Enum):
    """Why a plan is ``NONE``."""

    NO_HIT = "no stored tokens beyond the local hit"
    SMALL = "stored hit below min_load_tokens"
    OVERLAP = "the load would write into a block holding computed tokens"
    SLOWER = "the cost model predicts recompute is faster"
    SHORT_HANDOFF = "handoff: nothing stored beyond the next chunk boundary"


@dataclass(frozen=True, slots=True)
class Geometry:
    """``block_size``: tokens per engine block; ``chunk_tokens``: tokens per stored chunk (a multiple)."""

    block_size: int
    chunk_tokens: int

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.chunk_tokens <= 0 or self.chunk_tokens % self.block_size:
            raise ValueError(f"chunk_tokens ({self.chunk_tokens}) must be a positive multiple of "
                             f"block_size ({self.block_size})")

    @property
    def chunk_blocks(self) -> int:
        return self.chunk_tokens // self.block_size


@dataclass(frozen=True, slots=True)
class PlanInput:
    """What is known about one prompt when it is admitted.

    ``prompt_tokens``: prompt length. ``local_tokens``: tokens already in the engine's KV
    (prefix-cache hit). ``tiers``: tier name (``cpu``, ``disk``, ``remote``) of each leading
    stored chunk, in prompt order. ``remote``: a P/D consumer whose prefill ran elsewhere.
    """

    prompt_tokens: int
    local_tokens: int
    tiers: tuple[str, ...] = ()
    remote: bool = False


@dataclass(frozen=True, slots=True)
class Policy:
    """``min_load_tokens``: smallest load worth a trip (tokens). ``unaligned``: ``partial``,
    ``handoff`` or ``auto`` (cheapest by the cost model; ``partial`` while costs are unknown).
    ``handoff_supported``: the engine can pause a prefill at a chunk boundary (kvtier's scheduler
    is installed); without it ``handoff`` falls back to ``partial``. ``cut``: a plan may load fewer
    chunks than the hit holds (module docstring); off for hybrid models, whose other groups' hold
    is checked only at the hit's end (a windowed group's chunks there)."""

    min_load_tokens: int
    unaligned: str = "auto"
    handoff_supported: bool = True
    cut: bool = True  # a load may stop short of the hit on cost; False where the hit was checked only at its end

    def __post_init__(self) -> None:
        if self.unaligned not in UNALIGNED_MODES:
            raise ValueError(f"unaligned must be one of {UNALIGNED_MODES}, got {self.unaligned!r}")


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """A decision for one prompt. Tokens ``[local_tokens, load_start)`` are prefilled before the
    load (non-empty only for ``HANDOFF``); ``[load_start, load_end)`` are loaded; the rest is
    prefilled after. ``NONE`` plans have ``load_start == load_end == local_tokens``.
    ``stored_end``: where the stored hit ends (tokens), set when the cost model judged the plan
    (then the stored chunks ``[load_end, stored_end)`` are recomputed on cost); else None."""

    kind: PlanKind
    local_tokens: int
    load_start: int
    load_end: int
    skip: Skip | None = None
    predicted_s: float | None = None  # the chosen path's predicted seconds (load + the hit's recomputed rest)
    stored_end: int | None = None

    @property
    def cut_on_cost(self) -> bool:
        """Stored chunks are left to recompute because the cost model says loading them is slower
        (a ``Skip.SLOWER`` veto, or a load that stops short of the hit)."""
        return self.stored_end is not None and self.stored_end > self.load_end

    def unloaded_chunks(self, geometry: Geometry) -> range:
        """Indices of the stored chunks left to recompute on cost (see :attr:`cut_on_cost`); from
        the one holding ``load_end`` (a veto's floor may sit inside it)."""
        if not self.cut_on_cost:
            return range(0)
        return range(self.load_end // geometry.chunk_tokens, self.stored_end // geometry.chunk_tokens)

    @property
    def load_tokens(self) -> int:
        return self.load_end - self.load_start

    @property
    def boundary(self) -> int:
        """Where a handoff prefill stops and waits for the load (``local_tokens`` otherwise)."""
        return self.load_start

    @property
    def external_tokens(self) -> int:
        """Tokens the engine should count as externally computed at admission (0 for a handoff:
        it is admitted as a plain prefill and parked at the boundary)."""
        return self.load_tokens if self.kind in (PlanKind.LOAD, PlanKind.PARTIAL, PlanKind.REMOTE) else 0

    def chunks(self, geometry: Geometry) -> range:
        """Indices of the stored chunks the load fetches (whole chunks)."""
        if not self.load_tokens:
            return range(0)
        c = geometry.chunk_tokens
        return range(self.load_start // c, -(-self.load_end // c))

    def first_block(self, geometry: Geometry) -> int:
        """Block of the first fetched chunk where the load starts writing (non-zero only for ``PARTIAL``)."""
        return (self.load_start % geometry.chunk_tokens) // geometry.block_size

    def blocks(self, geometry: Geometry) -> range:
        """Indices (in the request's block table) of the engine blocks the load writes (a remote
        load also writes the prompt's last, partial block)."""
        b = geometry.block_size
        end = -(-self.load_end // b) if self.kind is PlanKind.REMOTE else self.load_end // b
        return range(self.load_start // b, end)


def none(local: int, skip: Skip) -> LoadPlan:
    return LoadPlan(PlanKind.NONE, local, local, local, skip)


def may_load(prompt_tokens: int, local_tokens: int, geometry: Geometry, policy: Policy) -> bool:
    """Whether a stored hit could still give a prompt of ``prompt_tokens`` a load beyond the engine's
    own ``local_tokens`` (whole chunks, at least ``min_load_tokens``). False: :func:`plan_load`
    would plan none whatever the tiers hold, so there is nothing to look up."""
    whole_chunks = prompt_tokens - prompt_tokens % geometry.chunk_tokens
    return whole_chunks - local_tokens >= policy.min_load_tokens


def plan_load(inp: PlanInput, geometry: Geometry, policy: Policy, costs: CostModel | None = None) -> LoadPlan:
    """Decide how ``inp``'s stored prefix reaches the engine. Pure; see the module docstring."""
    local, c, b = inp.local_tokens, geometry.chunk_tokens, geometry.block_size
    if local % b:
        return none(local, Skip.OVERLAP)  # the floor's block holds computed tokens: never load into it
    if inp.remote:
        if local >= (inp.prompt_tokens - 1) // b * b:
            return none(local, Skip.NO_HIT)
        return LoadPlan(PlanKind.REMOTE, local, local, inp.prompt_tokens)
    hit = min(len(inp.tiers) * c, inp.prompt_tokens - inp.prompt_tokens % c)
    if hit <= local:
        return none(local, Skip.NO_HIT)
    if hit - local < policy.min_load_tokens:
        return none(local, Skip.SMALL)
    known = costs is not None and costs.known(inp.tiers)
    # Only loads really measured may veto a load: an estimate that is wrong would never be
    # corrected, since vetoed loads measure nothing.
    recompute_s = costs.prefill_s(hit - local) if known and costs.measured(inp.tiers) else None
    # Else a suffix of tiers measured or probed (disk after an unmeasured CPU tier) may still be cut.
    cut_from = None if recompute_s is not None or not known else costs.vetoable_from(list(inp.tiers)) * c
    cut_from = cut_from if cut_from is None or cut_from < hit else None

    if local % c == 0:
        return _cheapest([LoadPlan(PlanKind.LOAD, local, local, hit)], hit, geometry, policy, inp.tiers, costs,
                         recompute_s, cut_from)

    boundary = local + (c - local % c)
    partial = LoadPlan(PlanKind.PARTIAL, local, local, hit)
    handoff = LoadPlan(PlanKind.HANDOFF, local, boundary, hit) if hit > boundary else None
    mode = policy.unaligned
    if mode == "handoff" and not policy.handoff_supported:
        mode = "partial"
    if mode == "partial":
        return _cheapest([partial], hit, geometry, policy, inp.tiers, costs, recompute_s, cut_from)
    if mode == "handoff":
        if handoff is None:
            return none(local, Skip.SHORT_HANDOFF)
        if handoff.load_tokens < policy.min_load_tokens:
            return none(local, Skip.SMALL)
        return _cheapest([handoff], hit, geometry, policy, inp.tiers, costs, recompute_s, cut_from)
    # auto
    if not known:
        return partial
    options = [partial]
    if handoff is not None and policy.handoff_supported and handoff.load_tokens >= policy.min_load_tokens:
        options.append(handoff)
    return _cheapest(options, hit, geometry, policy, inp.tiers, costs, recompute_s, cut_from)


def _cheapest(options: list[LoadPlan], hit: int, geometry: Geometry, policy: Policy, tiers: tuple[str, ...],
              costs: CostModel | None, recompute_s: float | None, cut_from: int | None = None) -> LoadPlan:
    """The cheapest by the cost model of ``options`` (plans to the hit's end ``hit``, in tokens;
    the earlier wins a tie), and, when the model may veto (``recompute_s``: seconds to recompute
    the hit past the floor), of each cut at an earlier chunk boundary (the longer wins a tie);
    recompute (``Skip.SLOWER``) when that is cheaper still. Without ``recompute_s`` but with ``cut_from``
    (tokens): of each cut at a boundary from there on, never a veto. Without a cost model: the first."""
    if costs is None or not costs.known(tiers):
        return options[0]
    cuts = recompute_s is not None or cut_from is not None
    if not cuts and len(options) == 1:
        return options[0]  # an estimate only: nothing to compare, and it may not veto (plan_load)
    scored = []
    for rank, option in enumerate(options):
        for plan in _cuts(option, hit, geometry, policy, cut_from or 0) if cuts else (option,):
            seconds = _cost(plan, geometry, tiers, costs) + costs.prefill_s(hit - plan.load_end)
            scored.append((seconds, rank, -plan.load_end, plan))
    least = min(o[0] for o in scored)
    # Costs equal but for rounding (a tier exactly as fast as prefill) tie: the longer load wins.
    seconds, _, _, best = min((o for o in scored if o[0] <= least * (1 + 1e-9)), key=lambda o: o[1:3])
    if recompute_s is not None and least > recompute_s:
        return LoadPlan(PlanKind.NONE, best.local_tokens, best.local_tokens, best.local_tokens, Skip.SLOWER,
                        recompute_s, hit)
    return dataclasses.replace(best, predicted_s=seconds, stored_end=hit if cuts else None)


def _cuts(plan: LoadPlan, hit: int, geometry: Geometry, policy: Policy, cut_from: int = 0) -> list[LoadPlan]:
    """``plan`` (which loads to ``hit``) and, where the policy allows, the same plan stopped at
    each earlier chunk boundary past its start, and at ``cut_from`` or later, that still loads
    ``min_load_tokens``."""
    if not policy.cut:
        return [plan]
    c = geometry.chunk_tokens
    first = plan.load_start + (c - plan.load_start % c)  # the first boundary past the start
    return [dataclasses.replace(plan, load_end=end) for end in range(first, hit + 1, c)
            if end - plan.load_start >= policy.min_load_tokens and end >= cut_from]


def _cost(plan: LoadPlan, geometry: Geometry, tiers: tuple[str, ...], costs: CostModel) -> float:
    """Seconds until the request can prefill its suffix, beyond what recompute would share."""
    fetched = [tiers[i] for i in plan.chunks(geometry)]
    seconds = costs.load_s(fetched, geometry.chunk_tokens)
    if plan.kind is PlanKind.HANDOFF:
        # The gap runs in its own engine step before the load can start.
        seconds += costs.step_s(plan.boundary - plan.local_tokens)
    return seconds


def tier_tokens(tiers: tuple[str, ...], start: int, end: int, chunk_tokens: int) -> dict[str, int]:
    """Tokens ``[start, end)`` of a load per tier, ``tiers`` naming the tier of each chunk from
    the one holding token ``start`` on."""
    counts: dict[str, int] = {}
    first = start // chunk_tokens
    for i, tier in enumerate(tiers):
        lo, hi = max(start, (first + i) * chunk_tokens), min(end, (first + i + 1) * chunk_tokens)
        counts[tier] = counts.get(tier, 0) + max(0, hi - lo)
    return counts
