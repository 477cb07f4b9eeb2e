"""Preemption with kvtier in the real CUDA vLLM engine: a KV cache too small for four concurrent
requests to finish together, so vLLM preempts (and later recomputes) some of them, against an
engine without a connector and the same settings.

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -m gpu tests/gpu``.

160 blocks of 16 tokens: four 600-token prompts take 152 of them at admission, and 64 generated
tokens each would need 168, so requests are preempted mid-decode. Round 0 computes the four
prompts (kvtier saves their two full chunks each); round 1, after ``reset_prefix_cache()``, runs
them again: with kvtier every request starts from two loaded chunks, and preempted requests may
be brought back partly from kvtier. Scheduling (and so batch shapes) differs between the engines,
so outputs are compared closely (see gpu_engines).
"""

from __future__ import annotations

import pytest

import gpu_engines as g

if (reason := g.skip_reason()) is not None:  # no CUDA or no CUDA vLLM: skip this module at collection
    pytest.skip(reason, allow_module_level=True)

pytestmark = pytest.mark.gpu

PROMPTS = [g.prompt(51 + i, 600) for i in range(4)]
SETTINGS = {"num_gpu_blocks_override": 160, "max_num_seqs": 4, "max_model_len": 2048, "max_tokens": 64}
ROUNDS = [{"prompts": PROMPTS}, {"prompts": PROMPTS, "reset": True, "pause_s": 0.5}]


@pytest.fixture(scope="module")
def runs(gpu_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-preemption")
    ref = g.spawn(g.engine_spec(gpu_model, ROUNDS, **SETTINGS), tmp, "ref")
    kvtier = g.spawn(g.engine_spec(gpu_model, ROUNDS, kvtier=g.kvtier_config(), **SETTINGS), tmp, "kvtier")
    return {"ref": ref, "kvtier": kvtier}


def test_preempted_request_reloads_identically(runs, record_property):
    ref, kv = runs["ref"], runs["kvtier"]
    summary = {name: {"preemptions": [r["preemptions"] for r in run["rounds"]],
                      "requests_with_cached_tokens": [sum(o["cached"] > 0 for o in r["outputs"])
                                                      for r in run["rounds"]],
                      "cached": [[o["cached"] for o in r["outputs"]] for r in run["rounds"]],
                      "kvtier_counts": run["counts"], "num_gpu_blocks": run["num_gpu_blocks"]}
               for name, run in runs.items()}
    record_property("preemption", summary)
    print(summary)
    for name, run in runs.items():  # the premise: vLLM did preempt (where it can be counted)
        for i, r in enumerate(run["rounds"]):
            if r["preemptions"] is not None:
                assert r["preemptions"] > 0, f"{name} round {i} preempted nothing: {summary}"
    # Round 1, after the reset: every request started from kvtier's two chunks; without it, from nothing.
    assert [o["cached"] for o in g.outputs(kv, 1)] == [2 * g.CHUNK] * len(PROMPTS), summary
    assert [o["cached"] for o in g.outputs(ref, 1)] == [0] * len(PROMPTS), summary
    assert not kv["counts"].get("loads_failed"), summary
    for i in range(len(PROMPTS)):
        for rnd in (0, 1):
            assert len(g.outputs(kv, rnd)[i]["tokens"]) == SETTINGS["max_tokens"]
            g.assert_close(g.outputs(kv, rnd)[i], g.outputs(ref, rnd)[i], f"prompt {i}, round {rnd}: kvtier vs none")
        g.assert_close(g.outputs(kv, 1)[i], g.outputs(kv, 0)[i], f"prompt {i}: reloaded round vs computed round")
