"""P/D and the disk tier between real CUDA vLLM engines of different TP sizes, in both directions.

P/D (needs two GPUs: skipped otherwise, with the count seen): P at TP=2 on GPUs 0 and 1 with D at
TP=1 on GPU 2, then P at TP=1 on GPU 0 with D at TP=2 on GPUs 1 and 2. With two GPUs D shares one
of P's (each engine takes 0.3 of its memory, P started first): the pieces travel through the CPU
tiers, so sharing changes no route. Each engine is a process of its own
(``kvtier.bench.pd_child``) with its own ``CUDA_VISIBLE_DEVICES``. The disk tier (needs two
GPUs): a disk tier written at TP=1 is reloaded by a fresh engine at TP=2, and one written at TP=2 at
TP=1, every chunk loaded (the reader builds its pieces from the writer's).

A D rank of the other TP size gathers its KV heads from the P ranks that hold them into its CPU
tier (:mod:`kvtier.pd.consumer.gather`), never into engine blocks. This directory's random-weight
model has 2 KV heads: a rank that got the wrong heads changes the answer. D's answer is compared
with P's answer to the same prompt again (P's own prefix hit), closely: the two TP sizes round
differently. Negative control: params listing P's chunk servers in the wrong order are refused
by P's ranks (their pieces hold other heads) and D recomputes.

Runs only on a CUDA vLLM; ``python -m pytest -q -m gpu tests/gpu/test_gpu_pd_hetero_tp.py``.
"""

from __future__ import annotations

import pytest

import gpu_engines as g

if (_reason := g.skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

from test_gpu_pd import _as_output, _ask  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

LENGTH = 4 * g.CHUNK + 1
LOADED = 4 * g.CHUNK


def _spec(model: str, tp: int) -> dict:
    return {"model": model, "connector": "kvtier", "load_format": "auto", "block_size": g.BLOCK,
            "max_model_len": g.MAX_MODEL_LEN, "gpu_memory_utilization": g.GPU_MEMORY_UTILIZATION,
            "engine_args": {"tensor_parallel_size": tp}, "kvtier": g.kvtier_config(pd_transport="nixl")}


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_pd_between_tp_sizes(p_tp, d_tp, gpu_model, tmp_path, monkeypatch):
    from kvtier.bench.pd_engine_proc import Engine

    g.skip_without_gpus(max(p_tp, d_tp), f"P at TP={p_tp} beside D at TP={d_tp}")
    import torch

    d_first = p_tp if torch.cuda.device_count() >= p_tp + d_tp else max(p_tp, d_tp) - d_tp  # else shares
    for key, value in g.child_env(multiprocess=True).items():
        monkeypatch.setenv(key, value)
    engines = []
    try:
        p = Engine("P", _spec(gpu_model, p_tp), str(tmp_path), env={"CUDA_VISIBLE_DEVICES": g.visible_devices(0, p_tp)})
        engines.append(p)
        d = Engine("D", _spec(gpu_model, d_tp), str(tmp_path),
                   env={"CUDA_VISIBLE_DEVICES": g.visible_devices(d_first, d_tp)})
        engines.append(d)

        pulled = g.prompt(600 + p_tp, LENGTH)
        params = p.ask(pulled, {"do_remote_decode": True})["params"]
        assert params and params["tp_size"] == p_tp and len(params["kvtier_endpoints"]) == p_tp, params
        got = _ask(d, pulled, params)
        assert got["cached"] >= LOADED, f"D loaded {got['cached']} tokens, expected {LOADED}:\n{d.log_tail()}"
        g.assert_close(_as_output(got), _as_output(_ask(p, pulled)), f"TP={p_tp} to TP={d_tp} vs P's own KV")

        if p_tp == 2:
            swapped = g.prompt(610, LENGTH)
            params = p.ask(swapped, {"do_remote_decode": True})["params"]
            params["kvtier_endpoints"] = params["kvtier_endpoints"][::-1]
            got = _ask(d, swapped, params)
            assert got["cached"] < g.CHUNK, f"D loaded {got['cached']} tokens from P's ranks in the wrong order"
            g.assert_close(_as_output(got), _as_output(_ask(p, swapped)), "recompute vs P")
    finally:
        for e in engines:
            e.stop()


PROMPT = g.prompt(620, 6 * g.CHUNK + g.BLOCK)  # whole chunks and one block: a reload hits all of it


@pytest.mark.parametrize("write_tp,read_tp", [(1, 2), (2, 1)], ids=["tp1-to-tp2", "tp2-to-tp1"])
def test_disk_tier_written_at_one_tp_size_reloads_at_another(write_tp, read_tp, gpu_model, tmp_path):
    g.skip_without_gpus(max(write_tp, read_tp), f"engines at TP={write_tp} and TP={read_tp}")
    disk = tmp_path / "disk"
    kvtier = g.kvtier_config(disk_path=str(disk), disk_bytes=1 << 30)
    files = write_tp * (len(PROMPT) // g.CHUNK)  # one piece per rank and chunk, one directory

    def spec(tp: int, rounds: list[dict], **extra) -> dict:
        return g.engine_spec(gpu_model, rounds, kvtier=kvtier, multiprocess=True,
                             engine_args={"tensor_parallel_size": tp}, **extra)

    first = g.spawn(spec(write_tp, [{"prompts": [PROMPT]}], wait_disk={"path": str(disk), "files": files,
                                                                     "timeout_s": 120}), tmp_path, "write")
    assert first["disk_files"] == files, f"{first['disk_files']} chunk files on disk, {files} expected"
    read = g.spawn(spec(read_tp, [{"prompts": [PROMPT]}, {"prompts": [PROMPT], "reset": True}]), tmp_path, "read")
    out, again = g.only(read, 0), g.only(read, 1)
    want = g.kvtier_hit(len(PROMPT))
    assert out["cached"] == want, f"TP={read_tp} loaded {out['cached']} tokens of TP={write_tp}'s, {want} expected"
    assert again["cached"] == want  # from its own pieces now, in its CPU tier
    g.assert_close(out, g.only(first, 0), f"TP={write_tp} disk tier read at TP={read_tp} vs the writer's compute")
    g.assert_strict(again, out, f"TP={read_tp}: its own pieces vs those built from TP={write_tp}'s")
