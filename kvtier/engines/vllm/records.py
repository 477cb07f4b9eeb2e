"""The scheduler half's record of each live request (:class:`Tracked`) and of a load it planned
(:class:`PlannedLoad`). Only :class:`kvtier.engines.vllm.scheduler_side.SchedulerSide` makes,
reads and changes them; they live in its table of requests and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from kvtier.jobs import LoadJob
from kvtier.keys import chunk_keys
from kvtier.pd import params as pd
from kvtier.scheduler_hooks import Geometry, LoadPlan, ReqState


@dataclass(slots=True)
class PlannedLoad:
    """A load handed (or about to be handed) to the workers."""

    job: LoadJob
    tiers: tuple[str, ...]  # tier of each chunk in job.keys
    start: int  # first token loaded
    issued_s: float | None = None  # clock when the job left in a step's metadata
    others: tuple[LoadJob, ...] = ()  # the other served groups' jobs for the same tokens (hybrid models)


@dataclass(slots=True)
class Tracked:
    """What the scheduler half remembers of a live request."""

    keys: list[bytes]  # chain keys of the prompt's full chunks, then of those its reply filled (``replies``)
    prompt_tokens: int
    root: bytes = b""  # the chain's namespace digest (model, cache salt)
    replies: bool = False  # the chunks its generated tokens fill are saved too
    tail: bytes | None = None  # key of the prompt's trailing partial chunk (P/D requests only)
    role: pd.Produce | pd.Consume | None = None
    transfer_id: str | None = None  # what a producer request publishes under
    published: bool = False  # a producer request's last chunk is planned
    remote_failed: bool = False  # a consumer's transfer failed once: the rest is recomputed, never retried
    load_failed: bool = False  # a load failed with nothing valid: recomputed at its next admission
    state: ReqState = ReqState.LOOKUP
    block_ids: list[int] = field(default_factory=list)
    group_blocks: list[list[int]] = field(default_factory=list)  # each other served group's, by slot - 1
    saved_chunks: int = 0  # chunks [0, saved_chunks) are stored or queued for saving
    plan: LoadPlan | None = None  # of the latest lookup; committed by allocated()
    tiers: tuple[str, ...] = ()  # of the latest lookup
    lookups: int = 0  # vLLM asks again every step a request waits for blocks
    handoff: LoadPlan | None = None  # committed handoff, until parked at its boundary
    load: PlannedLoad | None = None  # in flight
    last_save_step: int = -1
    save_after_first_token: bool = False  # a consumer's loaded prompt is saved only after its first token

    def full_chunks(self, computed: int, tokens: Sequence[int] | None, chunk_tokens: int) -> int:
        """Full chunks once ``computed`` tokens have KV: the prompt's, and where ``replies`` and
        ``tokens`` (prompt and output so far, the engine's list) are given, those the reply filled,
        whose chain keys :attr:`keys` gains here."""
        if not self.replies or tokens is None or computed <= self.prompt_tokens:
            return min(computed, self.prompt_tokens) // chunk_tokens
        full = min(computed, len(tokens)) // chunk_tokens
        if full > len(self.keys):
            self.keys = chunk_keys(tokens[: full * chunk_tokens], chunk_tokens, self.root, self.keys)
        return full

    def promotions(self, plan: LoadPlan, geometry: Geometry) -> list[bytes]:
        """Chain keys of the disk chunks ``plan`` (this request's, from its latest lookup) leaves
        to recompute on cost: read into the CPU tier in the background, the prompt's next sight
        is a CPU hit. Not a P/D request's (its chunks past the floor are the producer's); the caller
        asks none for a hybrid model (its other groups' chunks would stay on disk, under a CPU tier)."""
        if self.role is not None:
            return []
        return [self.keys[i] for i in plan.unloaded_chunks(geometry) if i < len(self.tiers) and self.tiers[i] == "disk"]

    def disk_keys(self) -> list[bytes]:
        """Chain keys of the chunks its latest lookup found on disk (none of a P/D request's)."""
        return [] if self.role is not None else [k for k, tier in zip(self.keys, self.tiers) if tier == "disk"]

    def tail_blocks(self, chunk_tokens: int, block_size: int) -> int:
        """Blocks of the prompt's trailing partial chunk, as its producer stored it (P/D: ``keys`` are the prompt's)."""
        return -(-(self.prompt_tokens - len(self.keys) * chunk_tokens) // block_size)
