"""A Mamba hybrid's reload in the real CUDA vLLM: attention KV and Mamba state come back from kvtier.

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -s -m gpu
tests/gpu/test_gpu_mamba_reload.py``. The Granite-4-like hybrid of ``test_gpu_hybrid.py`` runs
with prefix caching on (vLLM 0.26 turns it off by default for Mamba hybrids) in each Mamba cache
mode kvtier serves:

- ``align``: Mamba states exist only where a step ended, or (vLLM 0.32+) where the layers' prefill
  checkpoint wrote one inside a step, at the prompt's last block boundary; kvtier keeps the state
  at each chunk end where one exists, and loads the hit's last one;
- ``all`` (vLLM 0.26; later releases have no such mode, and the case skips): vLLM keeps every
  block's state; kvtier keeps and loads them all, like attention KV.

Rounds ``[P]``, ``[P]`` (vLLM's own prefix-cache hit), ``[reset, P]`` (kvtier's reload), in a
connector-less engine (``ref``) and with kvtier. The reload must serve what vLLM's own prefix
cache served (its last full block: the state there is the last step's end) and answer bit for
bit as ``ref``'s prefix-cache round does: the same tokens cached, the same suffix computed.
"""

from __future__ import annotations

import json
import typing

import pytest

import gpu_engines as g

if (reason := g.skip_reason()) is not None:  # no CUDA or no CUDA vLLM: skip this module at collection
    pytest.skip(reason, allow_module_level=True)

from test_gpu_hybrid import build  # noqa: E402

pytestmark = pytest.mark.gpu

P = g.prompt(61, 3000)
ROUNDS = [{"prompts": [P]}, {"prompts": [P]}, {"prompts": [P], "reset": True}]
KINDS = {"align": "mamba", "all": "mamba_all"}


CASES = [("granite_hybrid", "align"), ("granite_hybrid", "all"), ("nemotron_h", "align")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{m}" for f, m in CASES])
def runs(request, tmp_path_factory):
    family, mode = request.param
    import vllm
    from vllm.config import cache

    modes = typing.get_args(getattr(cache, "MambaCacheMode", None))
    if mode not in modes:
        pytest.skip(f"vLLM {vllm.__version__} has no mamba_cache_mode {mode!r} (only {', '.join(modes)})")
    tmp = tmp_path_factory.mktemp(f"{family}-{mode}")
    model = build(family, tmp / "model")
    engine_args = {"mamba_cache_mode": mode, "enable_prefix_caching": True}

    def spec(kvtier: dict | None) -> dict:
        return g.engine_spec(model, ROUNDS, kvtier=kvtier, block_size=None, engine_args=engine_args)

    return mode, {"ref": g.spawn(spec(None), tmp, "ref"), "kvtier": g.spawn(spec(g.kvtier_config()), tmp, "kvtier")}


def test_kvtier_serves_the_mamba_group(runs):
    mode, result = runs
    with open(result["kvtier"]["log"], errors="replace") as f:
        log = f.read()
    assert "kvtier is idle" not in log
    assert f"{KINDS[mode]}, " in log or f"{KINDS[mode]})" in log  # the groups it serves, named at start


def test_the_reload_answers_as_the_engines_own_prefix_hit(runs):
    mode, result = runs
    ref, kv = result["ref"], result["kvtier"]
    block = ref["block_size"]
    hit = g.local_hit(len(P), block)
    print(json.dumps({"mode": mode, "block_size": block, "cached": [g.only(kv, i)["cached"] for i in range(3)],
                      "ref_cached": [g.only(ref, i)["cached"] for i in range(3)],
                      "admissions": kv["rounds"][2]["admissions"], "counts": kv["counts"]}))
    assert g.only(ref, 1)["cached"] == hit  # vLLM's own hit: attention and Mamba state agree there
    assert g.only(kv, 2)["cached"] == hit and kv["rounds"][2]["admissions"].get("load") == 1
    assert kv["counts"].get("loads_ok", 0) >= 1 and not kv["counts"].get("loads_failed")
    for i in range(3):
        g.assert_strict(g.only(kv, i), g.only(ref, min(i, 1)), f"{mode}: round {i}")
