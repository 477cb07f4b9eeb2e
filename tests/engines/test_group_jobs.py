"""The other served groups' jobs on their own: window blocks, Mamba state, hits every group holds.

:class:`GroupJobs` takes a request's chunk keys and blocks as arguments, so these run without an
engine (the scheduler half's tests run it through vLLM's scheduler).
"""

from __future__ import annotations

import pytest

from kvtier.engines.vllm.group_jobs import GroupJobs, group_transfer
from kvtier.engines.vllm.groups import FULL, MAMBA, NULL_BLOCK, SLIDING, ServedGroup
from kvtier.jobs import RemoteSource
from kvtier.keys import group_key
from kvtier.lookup.protocol import VERSION, LookupReply
from kvtier.scheduler_hooks import Geometry, LoadPlan, PlanKind, Skip

BS, CHUNK = 16, 64  # 4 blocks a chunk
GEOMETRY = Geometry(BS, CHUNK)
KEYS = [bytes([i]) * 16 for i in range(1, 5)]  # a prompt of 4 full chunks
ANCHOR = ServedGroup(0, FULL)
WINDOW = ServedGroup(1, SLIDING, window=32)
STATE = ServedGroup(1, MAMBA)


def test_window_load_skips_the_null_blocks_before_the_window():
    jobs = GroupJobs((ANCHOR, WINDOW), GEOMETRY)
    ids = [NULL_BLOCK] * 13 + [113, 114, 115]  # blocks 13.. of 16 hold KV: chunk 3, from its second block
    (job,) = jobs.loads("r", KEYS, None, [ids], 0, 4 * CHUNK)
    assert (job.keys, job.first_block, job.block_ids, job.group) == ((group_key(KEYS[3], 1),), 1, (113, 114, 115), 1)
    assert jobs.loads("r", KEYS, None, [[NULL_BLOCK] * 16], 0, 4 * CHUNK) == ()


def test_a_remote_load_fetches_the_group_under_its_own_transfer():
    jobs = GroupJobs((ANCHOR, WINDOW), GEOMETRY)
    remote = RemoteSource("t", ("tcp://p:1",), 0)
    (job,) = jobs.loads("r", KEYS, None, [list(range(100, 116))], 2 * CHUNK, 4 * CHUNK, remote=remote, from_chunk=3)
    assert job.keys == tuple(group_key(k, 1) for k in KEYS[2:])
    assert job.remote == RemoteSource(group_transfer("t", 1), ("tcp://p:1",), 1)
    assert jobs.transfers("t") == ["t", "t/1"]


def test_mamba_loads_the_state_at_the_hit_end_only():
    jobs = GroupJobs((ANCHOR, STATE), GEOMETRY)
    ids = [NULL_BLOCK] * 7 + [207] + [NULL_BLOCK] * 8
    (job,) = jobs.loads("r", KEYS, None, [ids], 0, 2 * CHUNK)
    assert (job.keys, job.block_ids, job.tail_blocks) == ((group_key(KEYS[1], 1),), (207,), 0)
    with pytest.raises(RuntimeError, match="no Mamba state block"):
        jobs.loads("r", KEYS, None, [ids], 0, 3 * CHUNK)


def test_mamba_saves_a_chunk_state_only_where_the_step_ends_at_it():
    jobs = GroupJobs((ANCHOR, STATE), GEOMETRY)
    ids = list(range(200, 216))
    (save,) = jobs.saves("r", KEYS, None, 4 * CHUNK, [ids], 0, 2, 0, 2 * CHUNK)
    assert (save.keys, save.block_ids, save.group) == ((group_key(KEYS[1], 1),), (207,), 1)
    assert jobs.saves("r", KEYS, None, 4 * CHUNK, [ids], 0, 2, 0, 2 * CHUNK + 5) == []


def test_mamba_saves_the_states_vllm_names_at_chunk_ends_from_the_blocks_it_names():
    """A prefill checkpoint writes the state at 128 inside a step that ends at 133 (vLLM >= 0.32)."""
    jobs = GroupJobs((ANCHOR, STATE), GEOMETRY)
    named = [(1, 999, 2 * CHUNK), (1, 998, 2 * CHUNK - BS), (0, 997, CHUNK), (1, 996, 5 * CHUNK)]
    (save,) = jobs.saves("r", KEYS, None, 4 * CHUNK, [list(range(200, 216))], 0, 2, 0, 2 * CHUNK + 5, states=named)
    # the others: not a chunk end, another group's, past the prompt's keys
    assert (save.keys, save.block_ids) == ((group_key(KEYS[1], 1),), (999,))


def test_window_saves_only_chunks_still_in_the_window():
    jobs = GroupJobs((ANCHOR, WINDOW), GEOMETRY)
    ids = list(range(100, 116))
    # before this step 3 chunks were computed: the window read from token 161 on, block 10
    (save,) = jobs.saves("r", KEYS, None, 4 * CHUNK, [ids], 2, 4, 3 * CHUNK, 4 * CHUNK)
    assert save.keys == (group_key(KEYS[3], 1),) and save.block_ids == tuple(ids[12:16])
    (published,) = jobs.saves("r", KEYS, None, 4 * CHUNK, [[NULL_BLOCK] * 16], 0, 0, 0, 0, transfer="t")
    assert (published.keys, published.publish) == ((), "t/1")  # nothing new, but the transfer lives


class Lookup:
    """Holds every key but ``missing``; counts the lookups."""

    def __init__(self, missing=()):
        self.missing, self.calls = set(missing), 0

    def __call__(self, keys):
        self.calls += 1
        held = next((i for i, key in enumerate(keys) if key in self.missing), len(keys))
        return LookupReply(VERSION, ["cpu"] * held)


def test_a_hit_holds_as_far_as_every_group_holds_it():
    lookup = Lookup(missing={group_key(KEYS[3], 1)})
    assert GroupJobs((ANCHOR, WINDOW), GEOMETRY).held_chunks(KEYS, 4 * CHUNK, 4, lookup) == 3
    assert lookup.calls == 2
    lookup = Lookup()
    assert GroupJobs((ANCHOR,), GEOMETRY).held_chunks(KEYS, 4 * CHUNK, 4, lookup) == 4 and lookup.calls == 0
    # Mamba state: never the whole prompt (its last token runs again)
    assert GroupJobs((ANCHOR, STATE), GEOMETRY).held_chunks(KEYS, 4 * CHUNK, 4, Lookup()) == 3


def test_a_hybrid_consumer_stops_short_of_the_prompt_end():
    plan = LoadPlan(PlanKind.REMOTE, 0, 0, 4 * CHUNK + 10)
    assert GroupJobs((ANCHOR, WINDOW), GEOMETRY).remote_plan(plan, 4 * CHUNK + 10, 0).load_end == 4 * CHUNK
    assert GroupJobs((ANCHOR, STATE), GEOMETRY).remote_plan(plan, 4 * CHUNK, 0).load_end == 3 * CHUNK
    assert GroupJobs((ANCHOR,), GEOMETRY).remote_plan(plan, 4 * CHUNK + 10, 0) is plan
    short = GroupJobs((ANCHOR, WINDOW), GEOMETRY).remote_plan(LoadPlan(PlanKind.REMOTE, 0, 0, 10), 10, 0)
    assert (short.kind, short.skip) == (PlanKind.NONE, Skip.NO_HIT)
