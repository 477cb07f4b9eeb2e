"""Unaligned hits of a sliding-window hybrid in the real CUDA vLLM engine, the hybrid KV cache
manager on: the handoff prefills to the chunk boundary, parks, frees the sliding layers' blocks
their window no longer reads at the hit's end, and loads the global layers' chunks past the
boundary and the sliding layers' window.

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -m gpu
tests/gpu/test_gpu_hybrid_handoff.py``. A handoff needs vLLM 0.32's scheduler; on 0.26 the
engine loads partial chunks of every group instead, which this then checks. The Gemma-3-like model of ``test_gpu_hybrid.py`` (five
128-token sliding-window layers to one global), the rounds of ``test_gpu_unaligned.py`` (floors
half way into a chunk and one block short of a boundary), compared closely with the engine's
own first computation of each prompt (see gpu_engines).
"""

from __future__ import annotations

import pytest

import gpu_engines as g

if (_reason := g.skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

from test_gpu_hybrid import build  # noqa: E402
from test_gpu_unaligned import FLOOR, Q_FLOOR, handoffs_supported, spec  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-hybrid-handoff")
    return g.spawn(spec(build("gemma3", tmp / "model"), "handoff"), tmp, "handoff")


@pytest.mark.parametrize(("i", "recompute"), [(2, 0), (5, 3)])
def test_hybrid_handoff_is_identical_to_recompute(run, i, recompute):
    kind = "handoff" if handoffs_supported() else "partial"
    assert run["rounds"][i]["admissions"] == {kind: 1, "loads_ok": 1}, run["rounds"][i]["admissions"]
    g.assert_close(g.only(run, i), g.only(run, recompute), f"hybrid {kind}, round {i} vs recompute")


def test_hybrid_handoff_parked_and_loaded(run):
    if not handoffs_supported():
        pytest.skip("this vLLM's scheduler cannot cap a prefill at the boundary: partial chunks (checked above)")
    for i, floor in ((2, FLOOR), (5, Q_FLOOR)):
        # vLLM's own hit, where the handoff starts: the prompt's floor (0.32), or on 0.33 up to a
        # block less for this sliding-window hybrid (80 for a floor of 96); never past the floor.
        cached = g.only(run, i)["cached"]
        assert floor - g.BLOCK <= cached <= floor and cached % g.BLOCK == 0, (i, cached, floor)
    assert "handoff_park_failed" not in run["counts"] and run["counts"].get("handoff") == 2, run["counts"]
    assert "loads_failed" not in run["counts"], run["counts"]
    with open(run["log"], errors="replace") as f:
        log = f.read()
    assert "sliding_window" in log and "handoffs are off" not in log
