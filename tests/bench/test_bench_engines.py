"""``kvtier-bench ttft`` and ``kvtier-bench overhead`` end to end on a tiny model (real vLLM engines)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ["--hidden", "64", "--layers", "1"]

pytestmark = pytest.mark.e2e


ARGS = {
    "ttft": ["ttft", "--prompt-lens", "512", "--repeats", "1", "--engines", "in-process", "--settle-s", "1"],
    "overhead": ["overhead", "--short", "2", "--short-len", "32", "--decode", "4", "--long", "1", "--long-len", "512",
                 "--rounds", "1", "--alternations", "1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Both benches at once (each runs one engine at a time, and the box has two cores): name ->
    (the finished process, its JSON path)."""
    tmp = tmp_path_factory.mktemp("benches")
    procs = {name: subprocess.Popen([sys.executable, "-m", "kvtier.bench.cli", *args, *TINY_MODEL, "--json",
                                     str(tmp / f"{name}.json")], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, args in ARGS.items()}
    done = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), tmp / f"{name}.json")
    return done


def test_ttft_measures_every_mode_and_reloads_from_both_tiers(runs):
    run, out = runs["ttft"]
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "cpu/local" in run.stdout
    data = json.loads(out.read_text())
    assert data["identical"] == {"in-process": True}
    ms = data["ms"]["in-process"]["512"]
    assert set(ms) == {"recompute", "local", "cpu", "disk"} and all(v[0] > 0 for v in ms.values())
    loaded = data["loaded_tokens"]["in-process"]["512"]
    assert loaded["recompute"] == [0] and loaded["cpu"][0] >= 256 and loaded["disk"][0] >= 256  # really reloaded


def test_overhead_compares_kvtier_with_no_connector(runs):
    run, out = runs["overhead"]
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "kvtier / no connector" in run.stdout
    data = json.loads(out.read_text())
    assert data["identical"] and all(len(v) == 1 and v[0] > 0 for v in data["tokens_per_s"].values())
    assert data["hooks_ms"]["wait_for_save.calls"] > 0 and data["hooks_ms"]["save.gather"] > 0
