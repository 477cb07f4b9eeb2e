"""vLLM's default engine on CUDA, with kvtier: EngineCore in its own process and asynchronous
scheduling on (vLLM's default on CUDA), and several requests reloaded at once.

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -m gpu tests/gpu``.

One engine (async_scheduling left at vLLM's default). Six prompts run together three times:
computed (round 0); again, hitting vLLM's own prefix cache (round 1); after
``reset_prefix_cache()``, loaded from kvtier concurrently (round 2). Two prompts share three
chunks. Loads finish in their own time, so round 2 batches its suffixes differently from round 1:
outputs are compared closely (see gpu_engines); how many came out bit-identical is reported.
"""

from __future__ import annotations

import pytest

import gpu_engines as g

if (reason := g.skip_reason()) is not None:  # no CUDA or no CUDA vLLM: skip this module at collection
    pytest.skip(reason, allow_module_level=True)

pytestmark = pytest.mark.gpu

C_ = g.CHUNK
_S3 = g.prompt(63, 5 * C_ + 1)
PROMPTS = [
    g.prompt(61, C_ + 3),
    g.prompt(62, 3 * C_ + 9),
    _S3,
    g.prompt(64, 2 * C_ + 100),
    g.prompt(65, 7 * C_ + 16),
    _S3[: 3 * C_ + 5] + g.prompt(66, 2 * C_),  # shares three chunks (and 5 tokens) with the third
]
SHARED = 3 * C_ + 5


@pytest.fixture(scope="module")
def run(gpu_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-async")
    rounds = [{"prompts": PROMPTS}, {"prompts": PROMPTS}, {"prompts": PROMPTS, "reset": True, "pause_s": 0.5}]
    return g.spawn(g.engine_spec(gpu_model, rounds, kvtier=g.kvtier_config(), multiprocess=True), tmp, "default")


def test_async_scheduling_is_on_and_reloads_match(run, record_property):
    computed, local, reloaded = (g.outputs(run, i) for i in range(3))
    for i, p in enumerate(PROMPTS):
        # Round 0: vLLM caches a block when it is allocated, so the last prompt hits the blocks
        # its twin was given in the same step.
        assert computed[i]["cached"] == (SHARED // g.BLOCK * g.BLOCK if i == len(PROMPTS) - 1 else 0), (i, computed[i])
        assert local[i]["cached"] == g.local_hit(len(p)), (i, local[i]["cached"])
        assert reloaded[i]["cached"] == g.kvtier_hit(len(p)), (i, reloaded[i]["cached"], g.kvtier_hit(len(p)))
    identical = sum(g.strict_difference(reloaded[i], local[i]) is None for i in range(len(PROMPTS)))
    record_property("bit_identical_to_prefix_cache_round", f"{identical}/{len(PROMPTS)}")
    print(f"{identical}/{len(PROMPTS)} reloads bit-identical to the prefix-cache round")
    for i in range(len(PROMPTS)):
        g.assert_close(reloaded[i], local[i], f"prompt {i}: concurrent reload vs vLLM's prefix-cache hit")
        g.assert_close(reloaded[i], computed[i], f"prompt {i}: concurrent reload vs recompute")
    # vLLM's default on CUDA; checked last so that the reload's own result shows either way.
    assert run["async_scheduling"] is True, (
        f"vLLM {run['vllm_version']} runs kvtier with async_scheduling={run['async_scheduling']!r}")
