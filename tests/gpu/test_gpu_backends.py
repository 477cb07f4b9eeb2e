"""kvtier starts and reloads on every CUDA attention backend and KV cache dtype it supports.

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -m gpu tests/gpu``.

One engine per (backend, dtype), in its own process: a 2821-token prompt (eleven 256-token chunks
and 5 tokens) is computed, computed again (a hit in vLLM's own prefix cache), and after
``reset_prefix_cache()`` computed a third time, now loading its chunks from kvtier's CPU tier.

The references are this engine's own rounds (no second engine): round 0 ran before anything was
stored, so it is a plain recompute; round 1 served the same eleven chunks from vLLM's own
prefix cache and prefilled the same 5 tokens in the same step shape as the reload, so the reload
must equal it bit for bit (tokens and logprobs) when kvtier's bytes are the ones vLLM wrote.
"""

from __future__ import annotations

import pytest

import gpu_engines as g

if (reason := g.skip_reason()) is not None:  # no CUDA or no CUDA vLLM: skip this module at collection
    pytest.skip(reason, allow_module_level=True)

pytestmark = pytest.mark.gpu

P = g.prompt(1, 11 * g.CHUNK + 5)  # the tail is shorter than a block: vLLM's own hit is the 11 chunks
FULL = 11 * g.CHUNK

BACKENDS = [
    ("FLASH_ATTN", "auto"),
    ("TRITON_ATTN", "auto"),
    ("FLEX_ATTENTION", "auto"),
    ("FLASH_ATTN", "fp8"),
    ("TRITON_ATTN", "fp8"),
]


@pytest.mark.parametrize(("backend", "kv_cache_dtype"), BACKENDS, ids=[f"{b}-{d}" for b, d in BACKENDS])
def test_starts_and_reloads_on_every_backend(gpu_model, tmp_path, backend, kv_cache_dtype):
    spec = g.engine_spec(gpu_model, kvtier=g.kvtier_config(), attention_backend=backend,
                         kv_cache_dtype=kv_cache_dtype, rounds=[
                             {"prompts": [P]},                                  # computes, saves 11 chunks
                             {"prompts": [P]},                                  # vLLM's own prefix cache
                             {"prompts": [P], "reset": True, "pause_s": 0.5},  # loads from kvtier
                         ])
    result = g.spawn(spec, tmp_path, f"{backend}-{kv_cache_dtype}")
    computed, local, reloaded = (g.only(result, i) for i in range(3))

    assert result["block_size"] in (None, g.BLOCK), result["block_size"]
    assert computed["cached"] == 0
    assert local["cached"] == FULL == g.local_hit(len(P))
    assert reloaded["cached"] == FULL, f"kvtier loaded {reloaded['cached']} of {FULL} tokens (log {result['log']})"
    admissions = result["rounds"][2]["admissions"]  # kvtier's plan for the reload ({} if not in-process)
    if admissions:
        assert admissions.get("load") == 1 and admissions.get("loads_ok") == 1, admissions
    g.assert_strict(reloaded, local, f"{backend}/{kv_cache_dtype}: reload vs vLLM's own prefix-cache hit")
    g.assert_close(reloaded, computed, f"{backend}/{kv_cache_dtype}: reload vs recompute")
