"""P/D between two real CUDA vLLM engines on one GPU: a prefill engine (P) and a decode engine
(D), both with kvtier, each a process of its own (``kvtier.bench.pd_child``), D over NIXL (skipped
where NIXL is not installed) and over ZMQ.

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -m gpu tests/gpu``.

Each prompt is ``4 * CHUNK + 1`` tokens: D loads the 4 whole chunks and computes the last token
(as vLLM always does), and vLLM's own prefix cache on P holds exactly the 4 chunks' blocks, so D's
answer after a P/D transfer and P's answer to the same prompt again (a local prefix hit) run the
same computation on what must be the same KV bytes, and are compared bit for bit (tokens and top
logprobs). Pull:
P prefills (``do_remote_decode``), D answers with P's ``kv_transfer_params``. Push: both legs at
once under one ``transfer_id``. A negative control sends D a transfer P never published: D must
recompute (nothing loaded) and still answer like P. The GPU's memory must come back once both
stopped (as ``kvtier-bench pd-engines`` waits for it), before the next test's engines start: vLLM
checks the GPU's free memory as an engine starts.
"""

from __future__ import annotations

import uuid

import pytest

import gpu_engines as g

if (_reason := g.skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

LENGTH = 4 * g.CHUNK + 1
LOADED = 4 * g.CHUNK  # tokens D must load; the last one it computes


def _spec(model: str, transport: str) -> dict:
    return {"model": model, "connector": "kvtier", "load_format": "auto", "block_size": g.BLOCK,
            "max_model_len": g.MAX_MODEL_LEN, "gpu_memory_utilization": g.GPU_MEMORY_UTILIZATION,
            "kvtier": g.kvtier_config(pd_transport=transport)}


def _as_output(out: dict) -> dict:
    """A pd_child answer in gpu_engines' output form (``tokens``, ``top``)."""
    return {"tokens": out["tokens"], "top": [list(step.items()) for step in out["logprobs"] or []]}


def _ask(engine, prompt: list[int], params: dict | None = None) -> dict:
    engine.send(prompt, params, max_tokens=16, logprobs=g.TOP_LOGPROBS)
    return engine.receive()


@pytest.mark.parametrize("transport", ["nixl", "zmq"])
def test_pd_pull_push(transport, gpu_model, tmp_path, monkeypatch):
    from kvtier.bench.pd_engine_proc import RELEASE_SLACK_MIB, gpu_used_mib, wait_released
    from kvtier.bench.pd_engines import Engine
    from kvtier.pd import nixl

    if transport == "nixl" and not nixl.available():
        pytest.skip("NIXL is not installed here (pip install nixl-cu12, or nixl-cu13 beside CUDA 13)")
    for key, value in g.child_env(multiprocess=True).items():
        monkeypatch.setenv(key, value)
    gpu = g.visible_devices(0)
    before = gpu_used_mib(gpu)  # what the GPU holds again once both engines stopped
    engines = []
    try:
        p = Engine("P", _spec(gpu_model, "auto"), str(tmp_path))
        engines.append(p)
        d = Engine(f"D-{transport}", _spec(gpu_model, transport), str(tmp_path))
        engines.append(d)

        pulled = g.prompt(100, LENGTH)
        params = p.ask(pulled, {"do_remote_decode": True})["params"]
        assert params and params.get("kvtier_endpoints"), f"P published nothing: {params}"
        got = _ask(d, pulled, params)
        assert got["cached"] >= LOADED, f"{transport} pull: D loaded {got['cached']} tokens, expected {LOADED}"
        g.assert_strict(_as_output(got), _as_output(_ask(p, pulled)), f"{transport} pull vs P's own KV")

        pushed, transfer_id = g.prompt(200, LENGTH), uuid.uuid4().hex
        d.send(pushed, {"do_remote_prefill": True, "transfer_id": transfer_id, "tp_size": 1,
                        "kvtier_endpoints": params["kvtier_endpoints"]}, max_tokens=16, logprobs=g.TOP_LOGPROBS)
        p.send(pushed, {"do_remote_decode": True, "transfer_id": transfer_id})
        got, _ = d.receive(), p.receive()
        assert got["cached"] >= LOADED, f"{transport} push: D loaded {got['cached']} tokens, expected {LOADED}"
        g.assert_strict(_as_output(got), _as_output(_ask(p, pushed)), f"{transport} push vs P's own KV")

        # Negative control: a transfer P never published. D recomputes; the answer is still P's.
        unknown = g.prompt(300, LENGTH)
        got = _ask(d, unknown, {**params, "remote_request_id": "never-published"})
        assert got["cached"] < g.CHUNK, f"{transport}: D loaded {got['cached']} tokens of a transfer never published"
        g.assert_close(_as_output(got), _as_output(_ask(p, unknown)), f"{transport} recompute vs P")

        lines = [ln for ln in open(d.log_path, errors="replace") if "kvtier P/D: fetching from" in ln]
        assert lines and f"over {transport.upper()}" in lines[0], f"D's transport line: {lines[:1]}"
    finally:
        for e in engines:
            e.stop()
    if before is not None:  # the next test's engines check the GPU's free memory as they start
        released = wait_released(gpu, before)
        assert released["held_mib"] <= RELEASE_SLACK_MIB, f"P's and D's GPU memory still held: {released}"
