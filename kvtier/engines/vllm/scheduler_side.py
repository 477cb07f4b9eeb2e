"""Scheduler half of the vLLM connector: look up stored prefixes, plan loads and saves."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvtier.config import KvtierConfig
from kvtier.keys import chunk_keys, namespace
from kvtier.lookup import LookupClient
from kvtier.jobs import LoadJob, SaveJob

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Tracked:
    """What the scheduler half remembers of a live request."""

    keys: list[bytes]  # chain keys of the prompt's full chunks
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0  # chunks [0, saved_chunks) are stored or queued for saving
    lookup: tuple[int, list[str]] | None = None  # (local hit tokens, tiers) of the latest lookup
    load_tiers: list[str] = field(default_factory=list)  # tiers of the chunks being loaded


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the workers must do this step (the connector metadata's payload)."""

    loads: tuple[LoadJob, ...]
    saves: tuple[SaveJob, ...]


class SchedulerSide:
    """Turns vLLM scheduler events into :class:`StepPlan` s. Block ids are the first KV group's."""

    def __init__(self, config: KvtierConfig, model: str, block_size: int, endpoint: str):
        self.config = config
        self.model = model
        self.block_size = block_size
        self.chunk_tokens = config.chunk_tokens
        self.chunk_blocks = config.chunk_tokens // block_size
        self.client = LookupClient(endpoint, config.lookup_timeout_ms)
        self._requests: dict[str, _Tracked] = {}
        self._loads: list[LoadJob] = []

    def track(self, req_id: str, prompt: list[int], cache_salt: str | None) -> _Tracked:
        tracked = self._requests.get(req_id)
        if tracked is None:
            keys = chunk_keys(prompt, self.chunk_tokens, namespace(self.model, cache_salt))
            tracked = self._requests[req_id] = _Tracked(keys, len(prompt))
        return tracked

    def matched_tokens(self, req_id: str, prompt: list[int], cache_salt: str | None, local_tokens: int) -> int:
        """Stored tokens beyond the engine's own ``local_tokens`` (block-aligned); 0 when none.

        Only remembers the answer for :meth:`allocated`; calling it again changes nothing else.
        """
        tracked = self.track(req_id, prompt, cache_salt)
        tiers = self.client.prefix_tiers(tracked.keys)
        hit = len(tiers) * self.chunk_tokens
        tracked.lookup = (local_tokens, tiers)
        return max(0, hit - local_tokens)

    def allocated(self, req_id: str, block_ids: list[int], external_tokens: int) -> None:
        """Blocks are allocated: plan a load of ``external_tokens`` after the local hit."""
        tracked = self._requests.get(req_id)
        if external_tokens == 0 or tracked is None or tracked.lookup is None:
            return
        local, tiers = tracked.lookup
        tracked.lookup = None
        end = local + external_tokens
        first_chunk, end_chunk = local // self.chunk_tokens, end // self.chunk_tokens
        job = LoadJob(
            req_id,
            tuple(tracked.keys[first_chunk:end_chunk]),
            (local % self.chunk_tokens) // self.block_size,
            tuple(block_ids[local // self.block_size : end // self.block_size]),
        )
        self._loads.append(job)
        # Loaded chunks stay in the save plan: the worker skips the ones still stored, and a
        # chunk whose load failed is recomputed and must be saved again.
        tracked.load_tiers = tiers[first_chunk:end_chunk]

    def hit_sources(self, req_id: str) -> dict[str, int]:
        """Tokens of the planned load per tier name (``cpu`` / ``disk``)."""
        tracked = self._requests.get(req_id)
        counts: dict[str, int] = {}
        for tier in tracked.load_tiers if tracked else ():
            counts[tier] = counts.get(tier, 0) + self.chunk_tokens
        return counts

    def scheduled(self, req_id: str, block_ids: list[int] | None, replace: bool, computed_after: int) -> SaveJob | None:
        """A request runs this step and will have ``computed_after`` tokens computed; new full
        prompt chunks are saved. ``block_ids``: blocks added this step (all of them if ``replace``)."""
        tracked = self._requests.get(req_id)
        if tracked is None:
            return None
        if replace:
            tracked.block_ids = list(block_ids or ())
        elif block_ids:
            tracked.block_ids.extend(block_ids)
        full = min(computed_after, tracked.prompt_tokens) // self.chunk_tokens
        full = min(full, len(tracked.keys), len(tracked.block_ids) // self.chunk_blocks)
        if full <= tracked.saved_chunks:
            return None
        start, tracked.saved_chunks = tracked.saved_chunks, full
        blocks = tracked.block_ids[start * self.chunk_blocks : full * self.chunk_blocks]
        return SaveJob(req_id, tuple(tracked.keys[start:full]), tuple(blocks))

    def take_plan(self, saves: list[SaveJob]) -> StepPlan:
        loads, self._loads = tuple(self._loads), []
        return StepPlan(loads, tuple(saves))

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def close(self) -> None:
        self.client.close()
