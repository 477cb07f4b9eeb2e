"""kvtier's scheduler looks ahead in vLLM's waiting queue (kvtier.engines.vllm.scheduler): the disk
chunks of prompts still waiting that a step did not reach are promoted before their turn, a few
lookups a step, each request once; never a P/D request's, and nothing without a disk tier.

The queue forms as it does behind a slow disk: every disk hit is vetoed on cost (a recompute is
predicted faster), so each prompt recomputes and takes the step's token budget (see sched_harness)."""

from __future__ import annotations

import dataclasses
import random

import pytest

pytest.importorskip("vllm")

from sched_harness import VOCAB, Harness  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvtier.engines.vllm import scheduler  # noqa: E402

BS, CHUNK = 16, 64
PROMPTS = [[random.Random(seed).randrange(3, VOCAB) for _ in range(2 * CHUNK + 8)] for seed in range(6)]


@pytest.fixture
def queued():
    """Six prompts' chunks stored on disk, a disk slower than recomputing, the engine's prefix cache
    empty; yields the harness and, per step, (promoted keys, requests that had had their turn)."""
    h = Harness(block_size=BS, chunk_tokens=CHUNK, num_blocks=64, max_num_seqs=1, max_batched=2 * CHUNK)
    for p in PROMPTS:
        h.add(p, 1)
        h.drain()
    for key, (_, contents) in list(h.index.chunks.items()):
        h.index.put(key, "disk", contents)
    h.sched.reset_prefix_cache()
    for tokens in (1, 512) * 4:
        h.side.meter.record_step(tokens, 1e-3 + 1e-5 * tokens)  # recompute: 10 us a token
        h.side.meter.record_load("disk", tokens, 1e-4 + 1e-3 * tokens)  # a load from disk: 1 ms a token
    steps: list[tuple[list[bytes], set[str]]] = []
    take_plan = h.side.take_plan

    def recorded(*args, **kwargs):
        plan = take_plan(*args, **kwargs)
        steps.append((list(plan.promotes), {r for r, req in h.requests.items() if req.status != RequestStatus.WAITING}))
        return plan
    h.side.take_plan = recorded
    yield h, steps
    h.close()


def with_disk_tier(h: Harness, disk_path: str | None = "/a/disk/tier") -> None:
    h.side.config = dataclasses.replace(h.side.config, disk_path=disk_path)


def ahead(h: Harness, steps, req_id: str) -> bool:
    """Whether ``req_id``'s chunks were all promoted in a step before its turn."""
    early = {k for promoted, turned in steps if req_id not in turned for k in promoted}
    return set(h.keys[req_id]) <= early


def test_prompts_waiting_unreached_have_their_disk_chunks_promoted_before_their_turn(queued):
    h, steps = queued
    with_disk_tier(h)
    ids = [h.add(p, 1) for p in PROMPTS]
    h.drain()
    assert h.stats.plans["LOAD"] == 0, h.stats.plans  # every disk hit vetoed: each prompt waited its turn
    assert [r for r in ids if ahead(h, steps, r)] == ids[1:]  # the head had its turn at once
    # vLLM asked only about the head: the others were looked up, a few a step, from the step after on,
    # those further back in the queue first (they wait longer), each prompt's chunks in order
    assert steps[1][0] == [k for r in reversed(ids[1 : 1 + scheduler.LOOKUPS_PER_STEP]) for k in h.keys[r]]


def test_negative_control_nothing_is_looked_up_ahead_without_a_disk_tier(queued):
    h, steps = queued
    with_disk_tier(h, None)
    ids = [h.add(p, 1) for p in PROMPTS]
    h.drain()
    assert not any(ahead(h, steps, r) for r in ids)


def test_a_pd_request_waiting_is_not_looked_up_ahead(queued):
    h, steps = queued
    with_disk_tier(h)
    ids = [h.add(PROMPTS[0], 1), h.add(PROMPTS[1], 1, remote=True), h.add(PROMPTS[2], 1)]
    h.step()
    h.step()
    assert not ahead(h, steps, ids[1]) and ahead(h, steps, ids[2])


def test_a_request_vllm_asked_about_but_left_waiting_is_promoted_without_another_lookup(queued, monkeypatch):
    h, steps = queued
    with_disk_tier(h)
    ids = [h.add(p, 1) for p in PROMPTS[:3]]
    h.side.matched_tokens(ids[2], PROMPTS[2], None, 0)  # as vLLM asks before it finds no room for the request
    lookups = []
    lookup = h.side.client.lookup
    monkeypatch.setattr(h.side.client, "lookup", lambda keys, **kw: lookups.append(keys) or lookup(keys, **kw))
    h.step()
    h.step()
    assert ahead(h, steps, ids[1]) and ahead(h, steps, ids[2])
    assert h.keys[ids[1]] in lookups and h.keys[ids[2]] not in lookups  # its own lookup's tiers were used
