"""A Mamba hybrid's prefix hit where the attention and Mamba groups disagree, in the real CUDA vLLM.

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -m gpu
tests/gpu/test_gpu_mamba_hits.py``. The Granite-4-like hybrid of ``test_gpu_hybrid.py`` runs with
``mamba_cache_mode="align"``: its Mamba layers keep a state only where a step ended, its attention
layers every block. Rounds ``[A]``, ``[B]``: ``B`` shares ``A``'s first 1700 tokens, so the
attention group holds ``B``'s prefix to the last block before 1700 and the Mamba group holds no
state there.

vLLM 0.26 admits such a request, when any connector is configured, at the attention group's hit;
without that state its Mamba layers would start from the null block. kvtier has the scheduler
take the hit every group holds (``compat.agree_on_hybrid_hits``); 0.32+ asks the connector and,
as kvtier restores no lagging Mamba state, takes that hit itself. ``B``'s answer must equal a
connector-less engine's bit for bit. vLLM's own ``OffloadingConnector`` runs the same rounds beside
it, for the record (printed, not asserted).
"""

from __future__ import annotations

import json

import pytest

import gpu_engines as g

if (reason := g.skip_reason()) is not None:  # no CUDA or no CUDA vLLM: skip this module at collection
    pytest.skip(reason, allow_module_level=True)

from test_gpu_hybrid import build  # noqa: E402

pytestmark = pytest.mark.gpu

A = g.prompt(51, 3000)
B = A[:1700] + g.prompt(52, 300)
ROUNDS = [{"prompts": [A]}, {"prompts": [B]}]
AGREE_LINE = "has it take the hit every KV cache group holds"
ALIGN = {"mamba_cache_mode": "align", "enable_prefix_caching": True}  # off by default for Mamba hybrids


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-mamba-hits")
    model = build("granite_hybrid", tmp / "model")

    def spec(kvtier: dict | None, **engine_args) -> dict:
        return g.engine_spec(model, ROUNDS, kvtier=kvtier, block_size=None, engine_args={**ALIGN, **engine_args})

    runs = {"ref": g.spawn(spec(None), tmp, "ref"), "kvtier": g.spawn(spec(g.kvtier_config()), tmp, "kvtier")}
    try:
        runs["offload"] = g.spawn(spec(None, kv_offloading_size=1, kv_offloading_backend="native"), tmp, "offload")
    except g.EngineFailed as exc:  # for the record only
        print(json.dumps({"offloading_connector": f"failed: {str(exc)[-300:]}"}))
    return runs


def test_kvtier_makes_the_scheduler_take_the_hit_every_group_holds(runs):
    """vLLM 0.26: kvtier installs the agreed hit on the scheduler (one line). Releases that ask the
    connector (``supports_divergent_local_hybrid_hits``, 0.32+) take that hit themselves: no line."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    asks = hasattr(KVConnectorBase_V1, "supports_divergent_local_hybrid_hits")
    with open(runs["kvtier"]["log"], errors="replace") as f:
        assert sum(AGREE_LINE in line for line in f) == (0 if asks else 1)


def test_the_diverging_prompt_answers_as_without_a_connector(runs):
    g.assert_strict(g.only(runs["kvtier"], 0), g.only(runs["ref"], 0), "round A")
    g.assert_strict(g.only(runs["kvtier"], 1), g.only(runs["ref"], 1), "round B (attention and Mamba hits differ)")
    assert g.only(runs["kvtier"], 1)["cached"] == g.only(runs["ref"], 1)["cached"]
    offload = runs.get("offload") and g.strict_difference(g.only(runs["offload"], 1), g.only(runs["ref"], 1))
    print(json.dumps({"block_size": runs["ref"]["block_size"], "cached_B": {k: g.only(r, 1)["cached"]
                      for k, r in runs.items()}, "offloading_connector_B_differs": offload}))
