"""P/D of a Mamba hybrid between two real CUDA vLLM engines on one GPU: attention KV and Mamba
state travel.

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -s -m gpu
tests/gpu/test_gpu_pd_mamba.py``. The Granite-4-like hybrid of ``test_gpu_hybrid.py`` with prefix
caching on and ``mamba_cache_mode="align"`` (vLLM keeps a state where a step ended; its blocks
hold 144 tokens, so a kvtier chunk is one block). P's prefill of the 3000-token prompt ends a
step at the last block boundary, 2880, where it keeps that state; D loads the attention KV
through 2880 and that state, which is what P's own prefix cache then serves, so D's answer and
P's answer to the same prompt again run the same computation: compared bit for bit. A negative
control sends D a transfer P never published: D recomputes and still answers like P.
"""

from __future__ import annotations

import json

import pytest

import gpu_engines as g

if (_reason := g.skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

from test_gpu_hybrid import build  # noqa: E402
from test_gpu_pd import _as_output, _ask  # noqa: E402
from test_gpu_pd_hybrid import check_never_published_is_recomputed, logs, pd_pair, published  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

LENGTH = 3000


def _spec(model: str) -> dict:
    return {"model": model, "connector": "kvtier", "load_format": "auto", "max_model_len": g.MAX_MODEL_LEN,
            "gpu_memory_utilization": g.GPU_MEMORY_UTILIZATION, "kvtier": g.kvtier_config(pd_transport="auto"),
            "engine_args": {"mamba_cache_mode": "align", "enable_prefix_caching": True}}


def test_mamba_hybrid_pd_moves_attention_kv_and_state(tmp_path, monkeypatch):
    model = build("granite_hybrid", tmp_path / "model")
    with pd_pair(_spec(model), tmp_path, monkeypatch) as (p, d):
        prompt = g.prompt(402, LENGTH)
        params = published(p, prompt)
        got = _ask(d, prompt, params)
        again = _ask(p, prompt)
        print(json.dumps({"loaded": got["cached"], "p_prefix_hit": again["cached"]}))
        assert got["cached"] == again["cached"] == (LENGTH - 1) // 144 * 144, (got["cached"], again["cached"])
        g.assert_strict(_as_output(got), _as_output(again), "pull vs P's own KV and state")
        check_never_published_is_recomputed(p, d, params, g.prompt(403, LENGTH))
        for log in logs(p, d):
            assert "mamba" in log and "kvtier is idle" not in log
