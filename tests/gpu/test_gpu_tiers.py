"""kvtier's CPU tier and disk tier in the real CUDA vLLM engine, against an engine without it.

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -m gpu tests/gpu``.

Three engines, each in its own process, on the default attention backend with 16-token blocks and
256-token chunks:

- ``ref``, no connector: computes five prompts together, then each alone again (hits in vLLM's
  own prefix cache).
- ``first``, kvtier with a CPU and a disk tier: the same rounds, then for each prompt
  ``reset_prefix_cache()`` and the prompt again, loaded from the CPU tier; before it exits it
  waits until every chunk is on disk.
- ``fresh``, kvtier on the same disk directory in a new process (CPU tier empty): for each
  prompt, reset and the prompt, loaded from disk.

Prompt lengths: A and B end at most one block past their last chunk, so vLLM's own hit is
exactly what kvtier loads and the reload equals ``ref``'s prefix-cache round bit for bit; C is
whole chunks (kvtier loads all of it, vLLM recomputes the last token); D has a 200-token tail;
E is shorter than a chunk (never saved, nothing loaded). Pairs that compute differently are
compared closely (see gpu_engines).
"""

from __future__ import annotations

import pytest

import gpu_engines as g

if (reason := g.skip_reason()) is not None:  # no CUDA or no CUDA vLLM: skip this module at collection
    pytest.skip(reason, allow_module_level=True)

pytestmark = pytest.mark.gpu

C_, B_ = g.CHUNK, g.BLOCK
PROMPTS = {
    "A": g.prompt(21, 4 * C_ + 7),
    "B": g.prompt(22, 9 * C_ + B_),
    "C": g.prompt(23, 6 * C_),
    "D": g.prompt(24, 2 * C_ + 200),
    "E": g.prompt(25, 100),
}
NAMES = list(PROMPTS)
EXACT = {"A", "B"}  # kvtier's hit equals vLLM's own prefix-cache hit: same computation
CHUNK_FILES = sum(len(p) // C_ for p in PROMPTS.values())  # 21: each saved chunk is one file on disk

BATCH, LOCAL, RELOAD = 0, 1, 1 + len(NAMES)  # round indices: all together; each alone (local hit); each reloaded


def local_rounds() -> list[dict]:
    return [{"prompts": [PROMPTS[n]]} for n in NAMES]


def reload_rounds(pause_s: float) -> list[dict]:
    return [{"prompts": [PROMPTS[n]], "reset": True, "pause_s": pause_s if i == 0 else 0} for i, n in enumerate(NAMES)]


@pytest.fixture(scope="module")
def tiers(gpu_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-tiers")
    disk = tmp / "disk"
    kvtier = g.kvtier_config(disk_path=str(disk), disk_bytes=1 << 30)
    batch = [{"prompts": list(PROMPTS.values())}]
    ref = g.spawn(g.engine_spec(gpu_model, batch + local_rounds()), tmp, "ref")
    first = g.spawn(g.engine_spec(gpu_model, batch + local_rounds() + reload_rounds(0.5), kvtier=kvtier,
                                  wait_disk={"path": str(disk), "files": CHUNK_FILES, "timeout_s": 60}), tmp, "first")
    fresh = g.spawn(g.engine_spec(gpu_model, reload_rounds(0), kvtier=kvtier), tmp, "fresh")
    return {"ref": ref, "first": first, "fresh": fresh}


def expected_reload(name: str) -> int:
    return g.kvtier_hit(len(PROMPTS[name]))


def check_reload_count(out: dict, name: str, where: str) -> None:
    n = len(PROMPTS[name])
    if name == "C":  # all of it stored: vLLM recomputes the last token (and may count its block out)
        assert n - B_ <= out["cached"] <= n, (where, name, out["cached"])
    else:
        assert out["cached"] == expected_reload(name), (where, name, out["cached"], expected_reload(name))


def test_cpu_tier_reload_matches_recompute(tiers):
    ref, first = tiers["ref"], tiers["first"]
    # Computing with kvtier (saving every full chunk) computes exactly what the engine without it does.
    for i, name in enumerate(NAMES):
        assert g.outputs(first, BATCH)[i]["cached"] == 0 == g.outputs(ref, BATCH)[i]["cached"]
        g.assert_strict(g.outputs(first, BATCH)[i], g.outputs(ref, BATCH)[i],
                        f"{name}: computed with kvtier vs without")
    for i, name in enumerate(NAMES):
        local, ref_local = g.only(first, LOCAL + i), g.only(ref, LOCAL + i)
        assert local["cached"] == ref_local["cached"] == g.local_hit(len(PROMPTS[name]))
        g.assert_strict(local, ref_local, f"{name}: vLLM's own prefix-cache hit, kvtier on vs off")
    # After reset_prefix_cache(), from kvtier's CPU tier.
    for i, name in enumerate(NAMES):
        out = g.only(first, RELOAD + i)
        check_reload_count(out, name, "cpu")
        if name in EXACT:
            g.assert_strict(out, g.only(ref, LOCAL + i), f"{name}: CPU reload vs the same hit in vLLM's prefix cache")
        else:
            g.assert_close(out, g.only(ref, LOCAL + i), f"{name}: CPU reload vs vLLM's prefix-cache hit")
        g.assert_close(out, g.outputs(ref, BATCH)[i], f"{name}: CPU reload vs recompute without a connector")
    counts = first["counts"]
    if counts:  # kvtier's scheduler side, in-process: one load per stored prompt, none failed
        assert counts.get("load") == sum(1 for n in NAMES if expected_reload(n)), counts
        assert counts.get("loads_ok") == counts.get("load") and not counts.get("loads_failed"), counts


def test_disk_tier_survives_a_fresh_engine(tiers):
    first, fresh, ref = tiers["first"], tiers["fresh"], tiers["ref"]
    assert first["disk_files"] == CHUNK_FILES, f"{first['disk_files']} chunk files on disk, {CHUNK_FILES} expected"
    for i, name in enumerate(NAMES):
        out = g.only(fresh, i)
        check_reload_count(out, name, "disk")
        assert out["cached"] == g.only(first, RELOAD + i)["cached"]
        # The same plan as the CPU reload in `first`: the same computation on the same bytes.
        g.assert_strict(out, g.only(first, RELOAD + i), f"{name}: disk reload (fresh engine) vs CPU reload")
        if name in EXACT:
            g.assert_strict(out, g.only(ref, LOCAL + i), f"{name}: disk reload vs the same hit in vLLM's prefix cache")
        g.assert_close(out, g.outputs(ref, BATCH)[i], f"{name}: disk reload vs recompute without a connector")
    assert all(g.only(fresh, i)["cached"] > 0 for i, n in enumerate(NAMES) if expected_reload(n))
