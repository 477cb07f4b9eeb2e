"""The other served KV cache groups of a hybrid model: how far a hit holds in each, and their jobs.

Hybrid models (several served KV cache groups, :mod:`.groups`): lookups, plans and states run on
the anchor group's chunks (:mod:`.scheduler_side`); each other group is loaded and saved beside
it, chunk for chunk, under its own keys (:func:`kvtier.keys.group_key`), and a hit counts only as
far as every group holds the chunks it needs. A windowed group (sliding window, chunked local
attention) needs only the chunks its window still reads at the hit's end. Mamba state in align
mode is one block per chunk, the state at its end: saved where a step ends there, loaded for the
hit's last chunk only. A P/D producer publishes each group's chunks under a transfer name of
their own (:func:`group_transfer`), which the consumer fetches and ends on its own.

:class:`GroupJobs` knows the groups and the chunk geometry only; what it reads of a request (its
chunk keys, its blocks in each group) comes in as arguments, and it hands back jobs. Tokens and
blocks count from the prompt's start; a group's slot is its place in the served groups (the
anchor's 0, the others' from 1), as in :attr:`kvtier.jobs.LoadJob.group`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Iterable

from kvtier.engines.vllm.groups import MAMBA, MAMBA_KINDS, NULL_BLOCK, ServedGroup
from kvtier.jobs import LoadJob, RemoteSource, SaveJob
from kvtier.keys import group_key
from kvtier.scheduler_hooks import Geometry, LoadPlan, PlanKind, Skip

if TYPE_CHECKING:
    from kvtier.lookup.protocol import LookupReply

WINDOW_LOOKUPS = 4  # most lookups to find a hit every served group holds; past them the prompt recomputes


def group_transfer(transfer_id: str, slot: int) -> str:
    """What a P/D producer publishes a served group's chunks under (each group's chunks are one
    fetch of their own, which the consumer ends on its own)."""
    return f"{transfer_id}/{slot}"


class GroupJobs:
    """The jobs of the served groups beside the anchor, for the anchor's chunks.

    ``groups``: every served group, the anchor first (empty or one: the engine's one group, and
    there is nothing beside it). ``geometry``: the engine's block size and the stored chunk's
    tokens, which every served group shares.
    """

    def __init__(self, groups: tuple[ServedGroup, ...], geometry: Geometry):
        self.others = tuple(groups[1:])  # served groups beside the anchor, slot i + 1 each
        # Mamba state: vLLM runs a whole-prompt hit's last token again, from the state after it
        self.state_groups = any(g.kind in MAMBA_KINDS for g in groups)
        self.block_size = geometry.block_size
        self.chunk_tokens = geometry.chunk_tokens
        self.chunk_blocks = geometry.chunk_blocks

    def transfers(self, transfer_id: str) -> list[str]:
        """Every transfer name a P/D producer's prompt goes out under: the anchor's, then each
        other group's."""
        return [transfer_id, *(group_transfer(transfer_id, slot) for slot in range(1, len(self.others) + 1))]

    def held_chunks(self, keys: list[bytes], prompt_tokens: int, chunks: int,
                    lookup: Callable[[list[bytes]], LookupReply | None]) -> int:
        """Most of the leading ``chunks`` of chain ``keys`` (all held for the anchor group) that a
        hit may cover. With Mamba state not the prompt's whole (vLLM runs its last token again).
        Beside the anchor, as far as every other group holds them as a hit needs: a full-attention
        group every chunk, a windowed group the chunks its window covers at the hit's end, Mamba
        state in align mode the last one. ``lookup`` asks the lookup server for the needed keys,
        latest chunk first, so a missing one shortens the hit to end before it."""
        c = self.chunk_tokens
        if self.state_groups:
            chunks = min(chunks, (prompt_tokens - 1) // c)
        if not self.others or chunks <= 0:
            return max(chunks, 0)
        for _ in range(WINDOW_LOOKUPS):
            if chunks == 0:
                return 0
            needed = [(i, group_key(keys[i], slot)) for i in range(chunks - 1, -1, -1)
                      for slot, group in enumerate(self.others, 1) if i >= group.first_needed_token(chunks * c) // c]
            reply = lookup([key for _, key in needed])
            held = len(reply.tiers) if reply is not None else 0
            if held >= len(needed):
                return chunks
            chunks = needed[held][0]
        return 0

    def remote_plan(self, plan: LoadPlan, prompt_tokens: int, local_tokens: int) -> LoadPlan:
        """A P/D consumer's ``plan`` as the other groups allow: vLLM runs a whole prompt's last
        token again, but gives a windowed group only the blocks the window reads past the whole
        prompt, so a hybrid's consumer stops a block short; with Mamba state, at the last chunk's
        end before the last token (its state). Nothing to load (recompute) when that end is not
        past the engine's own ``local_tokens``."""
        if plan.kind is not PlanKind.REMOTE or not self.others:
            return plan
        unit = self.chunk_tokens if self.state_groups else self.block_size
        end = (prompt_tokens - 1) // unit * unit
        return dataclasses.replace(plan, load_end=end) if end > local_tokens else \
            LoadPlan(PlanKind.NONE, local_tokens, local_tokens, local_tokens, Skip.NO_HIT)

    def loads(self, req_id: str, keys: list[bytes], tail: bytes | None, group_blocks: list[list[int]],
              start: int, end: int, tail_blocks: int = 0, remote: RemoteSource | None = None,
              from_chunk: int = 0) -> tuple[LoadJob, ...]:
        """The other groups' jobs for tokens ``[start, end)`` of a request whose full chunks have
        chain ``keys`` (``tail``: its trailing partial chunk's, P/D only, of ``tail_blocks``
        blocks) and whose blocks in each other group are ``group_blocks`` (by slot - 1).

        A windowed group's blocks outside its window are vLLM's null block, a prefix of its list,
        and are not loaded; Mamba state in align mode loads the state at ``end`` into the one block
        vLLM gave it there. ``remote``: the anchor's P/D producer, whose chunks start at chunk
        ``from_chunk``."""
        c, b, jobs = self.chunk_tokens, self.block_size, []
        all_keys = keys + ([tail] if tail is not None else [])
        for slot, ids in enumerate(group_blocks, 1):
            if self.others[slot - 1].kind == MAMBA:
                state = ids[end // b - 1] if end % c == 0 and len(ids) >= end // b else NULL_BLOCK
                if state == NULL_BLOCK:
                    raise RuntimeError(f"kvtier: request {req_id} loads {end} tokens, where no Mamba state block "
                                       "was allocated")
                source = None if remote is None or from_chunk >= end // c else \
                    dataclasses.replace(remote, first_chunk=0, transfer_id=group_transfer(remote.transfer_id, slot))
                jobs.append(LoadJob(req_id, (group_key(keys[end // c - 1], slot),), 0, (state,), 0, source, group=slot))
                continue
            first, stop = start // b, min(-(-end // b), len(ids))
            while first < stop and ids[first] == NULL_BLOCK:
                first += 1
            if first < stop:
                lo, hi = first * b // c, -(-stop * b // c)
                source = None if remote is None or from_chunk >= hi else \
                    dataclasses.replace(remote, first_chunk=max(0, from_chunk - lo),
                                        transfer_id=group_transfer(remote.transfer_id, slot))
                jobs.append(LoadJob(req_id, tuple(group_key(k, slot) for k in all_keys[lo:hi]), (first * b % c) // b,
                                    tuple(ids[first:stop]), tail_blocks if hi > len(keys) else 0, source, group=slot))
        return tuple(jobs)

    def saves(self, req_id: str, keys: list[bytes], tail: bytes | None, prompt_tokens: int,
              group_blocks: list[list[int]], start: int, end: int, computed_before: int, computed_after: int,
              transfer: str | None = None, final: bool = False,
              states: Iterable[tuple[int, int, int]] = ()) -> list[SaveJob]:
        """The other groups' jobs saving chunks ``[start, end)`` of a request of ``prompt_tokens``
        tokens, whose full chunks have chain ``keys`` (``tail``: its trailing partial chunk's) and
        whose blocks in each other group are ``group_blocks`` (by slot - 1), in a step that takes
        it from ``computed_before`` to ``computed_after`` computed tokens.

        A windowed group saves a chunk only while all its blocks hold KV: not the null block
        (outside the window when the request was admitted) and not below what vLLM freed before
        this step (its blocks may be another request's by now). Mamba state in align mode: the
        last chunk's state, when this step ends at its end, and each of ``states`` (vLLM's
        ``(group id, block id, tokens)`` of the states this step writes) at a chunk's end; the
        state of any other position was never materialized. A P/D producer's (``transfer``: the
        anchor's transfer id) are published beside the anchor's, each group's under
        :func:`group_transfer`, the prompt's tail too when ``final``; each group then sends a job
        even with nothing new in it."""
        cb, jobs = self.chunk_blocks, []
        tail_end = -(-prompt_tokens // self.block_size)  # blocks through the prompt's last token
        for slot, group in enumerate(self.others, 1):
            ids = group_blocks[slot - 1] if slot <= len(group_blocks) else []
            if group.kind == MAMBA:
                c, state = self.chunk_tokens, ids[end * cb - 1] if len(ids) >= end * cb else NULL_BLOCK
                at = {end - 1: state} if computed_after == end * c and state != NULL_BLOCK else {}
                at.update({t // c - 1: block for g, block, t in states
                           if g == group.index and t % c == 0 and 0 < t // c <= len(keys)})
                saved_keys, blocks = [group_key(keys[i], slot) for i in at], list(at.values())
            else:
                live = group.first_needed_token(computed_before) // self.block_size
                chunks = [i for i in range(start, end) if i * cb >= live and len(ids) >= (i + 1) * cb
                          and NULL_BLOCK not in ids[i * cb : (i + 1) * cb]]
                saved_keys = [group_key(keys[i], slot) for i in chunks]
                blocks = [block for i in chunks for block in ids[i * cb : (i + 1) * cb]]
                if final and tail is not None and len(ids) >= tail_end and NULL_BLOCK not in ids[end * cb : tail_end]:
                    saved_keys.append(group_key(tail, slot))
                    blocks += ids[end * cb : tail_end]
            if saved_keys or transfer is not None:  # a producer's: each group's transfer says it is alive, then done
                publish_as = None if transfer is None else group_transfer(transfer, slot)
                jobs.append(SaveJob(req_id, tuple(saved_keys), tuple(blocks), publish=publish_as, final=final,
                                    group=slot))
        return jobs
