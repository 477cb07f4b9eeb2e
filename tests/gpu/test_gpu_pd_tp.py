"""P/D between two real CUDA vLLM engines at TP=2 each, rank to rank: P on GPUs 0 and 1, D on
GPUs 2 and 3 (needs four; skipped otherwise, with the count seen). Each engine is a process of
its own (``kvtier.bench.pd_child``, vLLM's multiprocess executor) with its own
``CUDA_VISIBLE_DEVICES``.

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -m gpu
tests/gpu/test_gpu_pd_tp.py``. This directory's random-weight model has 2 KV heads, one per
rank: a rank that got the other rank's shard, or none, changes the answer.

Prompts are ``4 * CHUNK + 1`` tokens: D loads the 4 whole chunks and computes the last token, and
its answer is compared bit for bit with P's answer to the same prompt again (P's own prefix hit
on the same KV bytes). Cases:

* pull while P's lease runs: each D rank READs its shard from the P rank of the same index,
  engine blocks to engine blocks (D's log says so for both of P's chunk servers);
* push (both legs at once): each D rank READs its shard from its P rank's blocks as P computes them;
* a transfer P never published: D recomputes and still answers like P (negative control).
"""

from __future__ import annotations

import uuid

import pytest

import gpu_engines as g

if (_reason := g.skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

from test_gpu_pd import _as_output, _ask  # noqa: E402
from test_gpu_pd_hbm import _wait_for_line  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

LENGTH = 4 * g.CHUNK + 1
LOADED = 4 * g.CHUNK
TP = 2


def _spec(model: str) -> dict:
    return {"model": model, "connector": "kvtier", "load_format": "auto", "block_size": g.BLOCK,
            "max_model_len": g.MAX_MODEL_LEN, "gpu_memory_utilization": g.GPU_MEMORY_UTILIZATION,
            "engine_args": {"tensor_parallel_size": TP}, "kvtier": g.kvtier_config(pd_transport="nixl")}


def test_pd_tp2_to_tp2_pull_and_push_rank_to_rank(gpu_model, tmp_path, monkeypatch):
    from kvtier.bench.pd_engine_proc import Engine

    g.skip_without_gpus(2 * TP, "P at TP=2 beside D at TP=2")
    for key, value in g.child_env(multiprocess=True).items():
        monkeypatch.setenv(key, value)
    engines = []
    try:
        p = Engine("P", _spec(gpu_model), str(tmp_path), env={"CUDA_VISIBLE_DEVICES": g.visible_devices(0, TP), "KVTIER_LOG_LEVEL": "DEBUG"})
        engines.append(p)
        d = Engine("D", _spec(gpu_model), str(tmp_path), env={"CUDA_VISIBLE_DEVICES": g.visible_devices(TP, TP), "KVTIER_LOG_LEVEL": "DEBUG"})
        engines.append(d)

        pulled = g.prompt(500, LENGTH)
        params = p.ask(pulled, {"do_remote_decode": True})["params"]
        assert params and len(params.get("kvtier_endpoints") or ()) == TP, f"P did not name {TP} chunk servers: {params}"
        assert params["tp_size"] == TP
        got = _ask(d, pulled, params)
        assert got["cached"] >= LOADED, f"HBM pull: D loaded {got['cached']} tokens, expected {LOADED}"
        landed = set(_wait_for_line(d, r"chunks from (\S+) land HBM to HBM", count=TP))
        assert landed == set(params["kvtier_endpoints"]), \
            f"D's ranks did not each READ from their P rank's engine blocks: {landed}; D's log ends:\n{d.log_tail()}"
        g.assert_strict(_as_output(got), _as_output(_ask(p, pulled)), "TP=2 HBM pull vs P's own KV")

        pushed, transfer_id = g.prompt(501, LENGTH), uuid.uuid4().hex
        d.send(pushed, {"do_remote_prefill": True, "transfer_id": transfer_id, "tp_size": TP,
                        "kvtier_endpoints": params["kvtier_endpoints"]}, max_tokens=16, logprobs=g.TOP_LOGPROBS)
        p.send(pushed, {"do_remote_decode": True, "transfer_id": transfer_id})
        got, _ = d.receive(), p.receive()
        assert got["cached"] >= LOADED, f"push: D loaded {got['cached']} tokens, expected {LOADED}"
        landed = _wait_for_line(d, rf"transfer {transfer_id} from \S+: 5 chunks landed", count=TP)
        assert len(landed) == TP, f"push: {len(landed)} of D's {TP} ranks said their 5 chunks landed"
        g.assert_strict(_as_output(got), _as_output(_ask(p, pushed)), "TP=2 push vs P's own KV")

        unknown = g.prompt(502, LENGTH)
        got = _ask(d, unknown, {**params, "remote_request_id": "never-published"})
        assert got["cached"] < g.CHUNK, f"D loaded {got['cached']} tokens of a transfer never published"
        g.assert_close(_as_output(got), _as_output(_ask(p, unknown)), "recompute vs P")
    finally:
        for e in engines:
            e.stop()
