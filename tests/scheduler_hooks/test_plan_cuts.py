"""Plans over hits that mix tiers chunk by chunk: a load stops at the chunk boundary the cost
model finds cheapest, never slower by the model than loading the whole hit or recomputing it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import event, given, settings, strategies as st

from kvtier.scheduler_hooks import CostModel, Geometry, LinearCost, PlanInput, PlanKind, Policy, Skip, plan_load

G = Geometry(block_size=16, chunk_tokens=64)
STEP = LinearCost(1e-3, 1e-5, 8)  # recompute: 10 us a token, 640 us a chunk
CPU = LinearCost(1e-4, 1e-7, 8)  # 6.4 us a chunk
SLOW_DISK = LinearCost(1e-4, 5e-5, 8)  # 3.2 ms a chunk: slower than recomputing it
FAST_DISK = LinearCost(1e-4, 1e-6, 8)  # 64 us a chunk
MIXED = ("cpu", "cpu", "disk", "disk")  # a 256-token hit: two chunks in CPU, two on disk


def plan(tiers=MIXED, local=0, prompt=300, unaligned="auto", disk=SLOW_DISK, cpu=CPU, cut=True, min_load=16,
         step=STEP):
    model = CostModel(step, {"cpu": cpu, "disk": disk})
    return plan_load(PlanInput(prompt, local, tiers), G, Policy(min_load, unaligned, True, cut), model)


def test_cpu_then_a_slow_disk_loads_only_the_cpu_chunks():
    p = plan()
    assert (p.kind, p.load_start, p.load_end, p.stored_end, p.skip) == (PlanKind.LOAD, 0, 128, 256, None)
    assert p.cut_on_cost and list(p.unloaded_chunks(G)) == [2, 3] and p.external_tokens == 128


def test_a_fast_disk_loads_the_whole_hit():
    p = plan(disk=FAST_DISK)
    assert (p.kind, p.load_end) == (PlanKind.LOAD, 256) and not p.cut_on_cost and not p.unloaded_chunks(G)


def test_negative_control_without_cuts_the_slow_disk_is_loaded_or_vetoed_whole():
    # Two CPU chunks (13 us) and two slow disk chunks (6.4 ms) against 2.6 ms of recompute.
    p = plan(cut=False)
    assert p.skip is Skip.SLOWER and list(p.unloaded_chunks(G)) == [0, 1, 2, 3]


def test_a_probed_disk_after_the_cpu_chunks_is_cut_there():
    # A probed disk beside a measured CPU tier is not `measured` (no veto), but its chunks, a suffix
    # of the hit, may be left to recompute: the probe's figure is a lower bound of their load.
    p = plan(disk=LinearCost(1e-4, 5e-5, 0, probed=True))
    assert (p.kind, p.load_end, p.stored_end) == (PlanKind.LOAD, 128, 256) and list(p.unloaded_chunks(G)) == [2, 3]
    unmeasured_cpu = plan(disk=LinearCost(1e-4, 5e-5, 0, probed=True), cpu=LinearCost(1e-4, 1e-7, 0))
    assert (unmeasured_cpu.kind, unmeasured_cpu.load_end) == (PlanKind.LOAD, 128)


def test_costs_the_model_may_not_judge_load_the_whole_hit_as_before():
    # Neither tier measured nor probed: no veto, no cut. A probed tier before an unjudged one: no cut either.
    p = plan(disk=LinearCost(1e-4, 5e-5, 0), cpu=LinearCost(1e-4, 1e-7, 0))
    assert (p.kind, p.load_end, p.stored_end) == (PlanKind.LOAD, 256, None) and not p.cut_on_cost
    q = plan(tiers=("disk", "disk", "cpu", "cpu"), disk=LinearCost(1e-4, 5e-5, 0, probed=True), cpu=LinearCost(1e-4, 1e-7, 0))
    assert (q.kind, q.load_end, q.stored_end) == (PlanKind.LOAD, 256, None)


def test_a_disk_hit_slower_than_recompute_is_still_a_veto():
    p = plan(tiers=("disk",) * 4)
    assert (p.kind, p.skip, p.load_end) == (PlanKind.NONE, Skip.SLOWER, 0)


def test_an_unaligned_floor_cuts_at_a_chunk_boundary():
    p = plan(local=80, unaligned="partial")  # the floor's chunk (from its block 1) and chunk 1
    assert (p.kind, p.load_start, p.load_end, p.first_block(G)) == (PlanKind.PARTIAL, 80, 128, 1)
    assert list(p.blocks(G)) == [5, 6, 7] and list(p.chunks(G)) == [1]
    # A handoff's own step (0.58 ms for its 48-token gap) pays only with a small fixed cost.
    h = plan(tiers=("cpu", "cpu", "cpu", "disk"), local=80, unaligned="handoff", step=LinearCost(1e-4, 1e-5, 8))
    assert (h.kind, h.boundary, h.load_end, h.external_tokens) == (PlanKind.HANDOFF, 128, 192, 0)


def test_a_cut_below_min_load_tokens_is_not_taken():
    # Loading only the two CPU chunks (128 tokens) is too small: the whole hit is judged instead.
    assert plan(min_load=192).skip is Skip.SLOWER


def _modelled_s(p, model, tiers, hit):
    """A plan's seconds by the model, from its fields alone."""
    if p.kind is PlanKind.NONE:
        return model.prefill_s(hit - p.local_tokens)
    c = G.chunk_tokens
    fetched = [tiers[i] for i in range(p.load_start // c, -(-p.load_end // c))]
    seconds = model.load_s(fetched, c) + model.prefill_s(hit - p.load_end)
    if p.kind is PlanKind.HANDOFF:
        seconds += model.step_s(p.boundary - p.local_tokens)
    return seconds


lines = st.builds(LinearCost, st.floats(0, 1e-3), st.floats(0, 1e-4), st.just(8))


@settings(max_examples=1500, deadline=None)
@given(st.integers(0, 1500), st.integers(0, 12), st.lists(st.sampled_from(["cpu", "disk", "shared"]), max_size=24),
       st.sampled_from(["partial", "handoff", "auto"]), st.integers(1, 200), lines, lines, lines, lines)
def test_a_plan_is_never_slower_by_the_model_than_loading_all_or_recomputing_all(
        prompt, local_blocks, tiers, mode, min_load, step, cpu, disk, shared):
    local = min(local_blocks * G.block_size, prompt - prompt % G.block_size)
    tiers = tuple(tiers[: prompt // G.chunk_tokens])
    model = CostModel(step, {"cpu": cpu, "disk": disk, "shared": shared})
    inp = PlanInput(prompt, local, tiers)
    p = plan_load(inp, G, Policy(min_load, mode, True), model)
    whole = plan_load(inp, G, Policy(min_load, mode, True, cut=False), model)  # the rule before cuts
    if whole.predicted_s is None:  # nothing to judge (no hit, too small, overlap...): the same plan
        assert p == whole
        return
    hit = whole.stored_end
    event("cut" if p.cut_on_cost and p.load_tokens else p.kind.value)
    assert p.stored_end == hit and p.local_tokens == local
    assert p.predicted_s == pytest.approx(_modelled_s(p, model, tiers, hit), rel=1e-9, abs=1e-15)
    assert p.predicted_s <= whole.predicted_s * (1 + 1e-9) + 1e-15  # the better of load-all and recompute-all
    assert p.predicted_s <= model.prefill_s(hit - local) * (1 + 1e-9) + 1e-15
    if p.kind is not PlanKind.NONE:
        assert p.load_end % G.chunk_tokens == 0 and p.load_tokens >= min_load and p.skip is None
        assert p.kind is whole.kind or whole.kind is PlanKind.NONE or mode == "auto"
        assert p.cut_on_cost == (p.load_end < hit)
    c = G.chunk_tokens
    if local % c == 0:  # loads only: the plan is the best of every cut and of recompute
        cuts = [dataclasses.replace(whole, kind=PlanKind.LOAD, load_start=local, load_end=end)
                for end in range(local + c, hit + 1, c) if end - local >= min_load]
        best = min([_modelled_s(cut, model, tiers, hit) for cut in cuts] + [model.prefill_s(hit - local)])
        assert p.predicted_s <= best * (1 + 1e-9) + 1e-15
