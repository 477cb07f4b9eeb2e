"""kvtier under vLLM's default compilation: ``torch.compile`` and CUDA graphs on, where the other
modules of this directory run eager (``enforce_eager=True``, quicker to start).

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -m gpu
tests/gpu/test_gpu_cuda_graphs.py``.

One engine with vLLM's defaults (engine core in its own process, async scheduling, compiled,
CUDA graphs of vLLM's default mode) and kvtier. Rounds: the prompts computed together; each
alone (vLLM's own prefix hit); after ``reset_prefix_cache()`` each alone, loaded from kvtier's
CPU tier; after another reset all together (loaded at once, then decoded as one batch: the decode
steps replay a graph of that batch size). This directory's random-weight model answers from its
context: a save that read the blocks before the replayed forward had written them, or a load the
next replay did not wait for, changes the answer.
"""

from __future__ import annotations

import pytest

import gpu_engines as g

if (reason := g.skip_reason()) is not None:
    pytest.skip(reason, allow_module_level=True)

pytestmark = pytest.mark.gpu

C_, B_ = g.CHUNK, g.BLOCK
PROMPTS = {
    "8k": g.prompt(71, g.MAX_MODEL_LEN - 2 * C_ + 7),  # 30 chunks and a 7-token tail
    "exact": g.prompt(72, 6 * C_ + B_),  # whole chunks and one block
    "short": g.prompt(73, 100),  # shorter than a chunk: nothing saved, nothing loaded
}
NAMES = list(PROMPTS)
EXACT = {"8k", "exact"}  # kvtier loads exactly what vLLM's own prefix cache would hit
BATCH, LOCAL, RELOAD, TOGETHER = 0, 1, 1 + len(NAMES), 1 + 2 * len(NAMES)
START_TIMEOUT_S = 480  # compiling and capturing the graphs come on top of an eager engine's start


@pytest.fixture(scope="module")
def run(gpu_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-cuda-graphs")
    everything = list(PROMPTS.values())
    rounds = ([{"prompts": everything}]
              + [{"prompts": [PROMPTS[n]]} for n in NAMES]
              + [{"prompts": [PROMPTS[n]], "reset": True, "pause_s": 0.5 if i == 0 else 0} for i, n in enumerate(NAMES)]
              + [{"prompts": everything, "reset": True, "pause_s": 0.5}])
    spec = g.engine_spec(gpu_model, rounds, kvtier=g.kvtier_config(), multiprocess=True,
                         engine_args={"enforce_eager": False})
    return g.spawn(spec, tmp, "graphs", timeout_s=START_TIMEOUT_S)


def test_the_engine_ran_compiled_with_cuda_graphs(run):
    assert run["enforce_eager"] is False, run["enforce_eager"]
    assert run["cudagraph_mode"] not in ("None", "NONE", "CUDAGraphMode.NONE"), run["cudagraph_mode"]
    print(f"vLLM {run['vllm_version']}: cudagraph_mode {run['cudagraph_mode']}, started in {run['start_s']:.1f} s")


def test_reloads_under_cuda_graphs_match_the_engines_own_hits(run):
    for i, name in enumerate(NAMES):
        local, reload = g.only(run, LOCAL + i), g.only(run, RELOAD + i)
        want = g.kvtier_hit(len(PROMPTS[name]))
        assert reload["cached"] == want, f"{name}: {reload['cached']} tokens cached after the reset, {want} expected"
        if name in EXACT:
            g.assert_strict(reload, local, f"{name}: reload vs vLLM's own hit, CUDA graphs on")
        else:
            g.assert_close(reload, local, f"{name}: reload vs vLLM's own hit, CUDA graphs on")
        g.assert_close(reload, g.outputs(run, BATCH)[i], f"{name}: reload vs recompute, CUDA graphs on")


def test_a_batch_reloaded_at_once_decodes_alike(run):
    together = g.outputs(run, TOGETHER)
    for i, name in enumerate(NAMES):
        assert together[i]["cached"] == g.kvtier_hit(len(PROMPTS[name])), (name, together[i]["cached"])
        g.assert_close(together[i], g.only(run, LOCAL + i), f"{name}: batch reload vs vLLM's own hit")
