"""P/D of a sliding-window hybrid between two real CUDA vLLM engines on one GPU, the hybrid KV cache
manager on in both: every KV cache group's chunks travel (the global layers' every block, the
sliding layers' window).

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -s -m gpu
tests/gpu/test_gpu_pd_hybrid.py``. The Gemma-3-like model of ``test_gpu_hybrid.py`` (five
128-token sliding-window layers to one global). The prompt is ``4 * CHUNK + 20`` tokens: a
hybrid's consumer loads through the last full block before the prompt's last token, which is
exactly what P's own prefix cache then serves, so D's answer and P's answer to the same prompt
again run the same computation on what must be the same KV bytes: compared bit for bit. A
negative control sends D a transfer P never published: D recomputes and still answers like P.
"""

from __future__ import annotations

import contextlib
import json

import pytest

import gpu_engines as g

if (_reason := g.skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

from test_gpu_hybrid import build  # noqa: E402
from test_gpu_pd import _as_output, _ask  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

LENGTH = 4 * g.CHUNK + 20
LOADED = g.local_hit(LENGTH)  # through the last full block before the last token


def _spec(model: str) -> dict:
    return {"model": model, "connector": "kvtier", "load_format": "auto", "block_size": g.BLOCK,
            "max_model_len": g.MAX_MODEL_LEN, "gpu_memory_utilization": g.GPU_MEMORY_UTILIZATION,
            "kvtier": g.kvtier_config(pd_transport="auto")}


@contextlib.contextmanager
def pd_pair(spec: dict, tmp_path, monkeypatch):
    """P and D, two engines of ``spec`` on the GPU; stopped at the end."""
    from kvtier.bench.pd_engines import Engine

    for key, value in g.child_env(multiprocess=True).items():
        monkeypatch.setenv(key, value)
    engines = []
    try:
        engines.append(Engine("P", spec, str(tmp_path)))
        engines.append(Engine("D", spec, str(tmp_path)))
        yield engines
    finally:
        for e in engines:
            e.stop()


def published(p, prompt: list[int]) -> dict:
    """The ``kv_transfer_params`` P answers ``prompt``'s prefill leg with."""
    params = p.ask(prompt, {"do_remote_decode": True})["params"]
    assert params and params.get("kvtier_endpoints"), f"P published nothing: {params}"
    return params


def check_never_published_is_recomputed(p, d, params: dict, prompt: list[int]) -> None:
    """Negative control: D asked for a transfer P never published recomputes, and answers like P."""
    got = _ask(d, prompt, {**params, "remote_request_id": "never-published"})
    assert got["cached"] < g.CHUNK, f"D loaded {got['cached']} tokens of a transfer never published"
    g.assert_close(_as_output(got), _as_output(_ask(p, prompt)), "recompute vs P")


def logs(*engines) -> list[str]:
    """Each engine's log, as its process wrote it."""
    texts = []
    for engine in engines:
        with open(engine.log_path, errors="replace") as f:
            texts.append(f.read())
    return texts


def test_hybrid_pd_moves_every_group(tmp_path, monkeypatch):
    model = build("gemma3", tmp_path / "model")
    with pd_pair(_spec(model), tmp_path, monkeypatch) as (p, d):
        prompt = g.prompt(400, LENGTH)
        params = published(p, prompt)
        got = _ask(d, prompt, params)
        print(json.dumps({"loaded": got["cached"], "expected": LOADED}))
        assert got["cached"] == LOADED, f"D loaded {got['cached']} tokens, expected {LOADED}"
        g.assert_strict(_as_output(got), _as_output(_ask(p, prompt)), "pull vs P's own KV")
        check_never_published_is_recomputed(p, d, params, g.prompt(401, LENGTH))
        for log in logs(p, d):
            assert "KV cache groups (" in log and "kvtier is idle" not in log
