"""Load plans: thresholds, alignment and the auto choice, exhaustively over small geometries."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvtier.scheduler_hooks import CostModel, Geometry, LinearCost, PlanInput, PlanKind, Policy, Skip, plan_load

G = Geometry(block_size=16, chunk_tokens=64)
CPU4 = ("cpu",) * 4  # four stored chunks: a 256-token hit


def plan(local, tiers=CPU4, prompt=300, unaligned="auto", min_load=16, costs=None, handoff=True, remote=False):
    return plan_load(PlanInput(prompt, local, tiers, remote), G, Policy(min_load, unaligned, handoff), costs)


def costs(step_fixed=1e-3, per_token=1e-4, load_fixed=0.0, load_per_token=1e-6, tiers=("cpu", "disk")):
    loads = {t: LinearCost(load_fixed, load_per_token, 8) for t in tiers}
    return CostModel(LinearCost(step_fixed, per_token, 8), loads)


def test_aligned_floor_loads_whole_chunks():
    p = plan(64)
    assert (p.kind, p.load_start, p.load_end, p.first_block(G)) == (PlanKind.LOAD, 64, 256, 0)
    assert list(p.chunks(G)) == [1, 2, 3]
    assert p.external_tokens == 192


def test_unaligned_floor_partial_starts_at_the_floors_block():
    p = plan(80, unaligned="partial")
    assert (p.kind, p.load_start, p.first_block(G), list(p.chunks(G)), list(p.blocks(G))) == \
        (PlanKind.PARTIAL, 80, 1, [1, 2, 3], list(range(5, 16)))


def test_unaligned_floor_handoff_prefills_to_the_boundary():
    p = plan(80, unaligned="handoff")
    assert (p.kind, p.boundary, p.load_end, p.first_block(G), p.external_tokens) == (PlanKind.HANDOFF, 128, 256, 0, 0)


def test_handoff_with_nothing_beyond_the_boundary_recomputes():
    assert plan(80, tiers=("cpu", "cpu"), unaligned="handoff").skip is Skip.SHORT_HANDOFF


def test_handoff_without_kvtier_scheduler_is_partial():
    assert plan(80, unaligned="handoff", handoff=False).kind is PlanKind.PARTIAL


def test_small_hits_are_skipped():
    assert plan(192, min_load=128).skip is Skip.SMALL
    assert plan(192, min_load=64).kind is PlanKind.LOAD


def test_no_hit_beyond_the_local_floor():
    assert plan(256).skip is Skip.NO_HIT
    assert plan(0, tiers=()).skip is Skip.NO_HIT


def test_a_floor_inside_a_block_never_loads():
    assert plan(70).skip is Skip.OVERLAP


def test_cost_model_skips_loads_slower_than_recompute():
    slow = costs(load_fixed=1.0)
    assert plan(64, costs=slow).skip is Skip.SLOWER
    fast = plan(64, costs=costs())
    assert fast.kind is PlanKind.LOAD and fast.predicted_s is not None


def test_unknown_costs_never_veto_and_auto_picks_partial():
    half = CostModel(LinearCost(1e-3, 1e-4, 8), {})  # no tier measured yet
    assert plan(64, costs=half).kind is PlanKind.LOAD
    assert plan(80, costs=half).kind is PlanKind.PARTIAL
    assert plan(80).kind is PlanKind.PARTIAL


def test_auto_picks_handoff_when_the_floors_chunk_costs_more_than_a_step_and_the_gap():
    # A slow tier (50 us per token fetched, against 100 us per token prefilled): partial fetches
    # the floor's whole chunk (64 tokens, 3.2 ms); handoff pays one step (1 ms) and prefills the
    # gap to the boundary instead: 16 tokens (2.6 ms in all) wins, 48 tokens (5.8 ms) loses.
    slow = costs(step_fixed=1e-3, per_token=1e-4, load_per_token=5e-5)
    assert plan(112, costs=slow).kind is PlanKind.HANDOFF
    assert plan(80, costs=slow).kind is PlanKind.PARTIAL
    # A fast tier (1 us per token): the chunk costs 64 us, far below one step: partial.
    assert plan(112, costs=costs()).kind is PlanKind.PARTIAL


def test_auto_recomputes_when_both_are_slower():
    assert plan(80, costs=costs(load_fixed=10.0)).skip is Skip.SLOWER


def test_remote_loads_the_whole_prompt_past_the_floor():
    p = plan(64, tiers=(), remote=True)
    assert (p.kind, p.load_start, p.load_end) == (PlanKind.REMOTE, 64, 300)


def test_policy_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="unaligned"):
        Policy(16, "sometimes")


geometries = st.sampled_from([Geometry(16, 16), Geometry(16, 64), Geometry(32, 64), Geometry(16, 256),
                              Geometry(32, 128)])


@settings(max_examples=2000, deadline=None)
@given(geometries, st.integers(0, 2000), st.integers(0, 40), st.lists(st.sampled_from(["cpu", "disk"]), max_size=40),
       st.sampled_from(["partial", "handoff", "auto"]), st.integers(1, 300), st.booleans(), st.booleans(),
       st.floats(0, 1e-2), st.floats(0, 1e-3), st.floats(0, 1e-2), st.floats(0, 1e-4))
def test_every_plan_respects_blocks_chunks_and_thresholds(g, prompt, local_blocks, tiers, mode, min_load, handoff,
                                                         known, step_fixed, per_token, load_fixed, load_per_token):
    local = min(local_blocks * g.block_size, prompt - prompt % g.block_size)
    tiers = tuple(tiers[: prompt // g.chunk_tokens])
    model = costs(step_fixed, per_token, load_fixed, load_per_token) if known else None
    p = plan_load(PlanInput(prompt, local, tiers), g, Policy(min_load, mode, handoff), model)
    assert p.local_tokens == local
    if p.kind is PlanKind.NONE:
        assert p.skip is not None and p.load_tokens == 0 and p.external_tokens == 0
        return
    hit = len(tiers) * g.chunk_tokens
    assert local <= p.load_start < p.load_end <= hit <= prompt
    assert p.load_start % g.block_size == 0 and p.load_end % g.chunk_tokens == 0  # never into a computed block
    assert p.load_tokens >= min_load
    assert p.first_block(g) < g.chunk_blocks
    assert len(p.blocks(g)) * g.block_size == p.load_tokens
    # A load used to run to the end of the hit always; now the cost model may stop it at an
    # earlier chunk boundary (a hit mixing fast and slow tiers), and only then.
    assert p.chunks(g).start == p.load_start // g.chunk_tokens and p.chunks(g).stop == p.load_end // g.chunk_tokens
    assert p.load_end == hit or (model is not None and p.cut_on_cost and p.stored_end == hit)
    if p.kind is PlanKind.LOAD:
        assert local % g.chunk_tokens == 0 and p.load_start == local
    if p.kind is PlanKind.PARTIAL:
        assert local % g.chunk_tokens and p.load_start == local
    if p.kind is PlanKind.HANDOFF:
        assert handoff and mode != "partial"
        assert p.load_start % g.chunk_tokens == 0 and p.load_start - local < g.chunk_tokens and p.external_tokens == 0
    if model is not None:  # the load, and the prefill of the hit past it
        assert p.predicted_s <= model.prefill_s(hit - local) * (1 + 1e-9) + 1e-15


def test_estimated_costs_choose_between_partial_and_handoff_but_never_veto():
    # A worker's per-chunk figure (samples=0) that claims loads are very slow.
    estimate = CostModel(LinearCost(1e-3, 1e-4, 8), {"cpu": LinearCost(1e-3, 1.0, 0)})
    assert plan(64, costs=estimate).kind is PlanKind.LOAD
    assert plan(112, costs=estimate).kind is PlanKind.HANDOFF  # one step beats a 64 s chunk
