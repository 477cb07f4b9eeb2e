"""``kvtier-bench pd-transfer`` end to end on a small geometry, as a user runs it (a subprocess)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pd_transfer_verifies_and_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    run = subprocess.run([sys.executable, "-m", "kvtier.bench.cli", "pd-transfer", "--prompt-len", "1k",
                          "--layers", "2", "--repeats", "2", "--json", str(out), "--plot", str(png)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for row in ("raw ZMQ", "raw NIXL READ", "kvtier over ZMQ", "kvtier over NIXL, pull", "kvtier over NIXL, push"):
        assert row in run.stdout, run.stdout
    data = json.loads(out.read_text())
    assert data["kv_bytes"] == 1024 * 2 * 2 * 4 * 64 * 4  # tokens x layers x (K, V) x heads x dim x float32
    for key in ("memcpy_ms", "zmq_ms", "kvtier_ms", "nixl_ms", "kvtier_nixl_ms", "kvtier_push_ms"):
        assert len(data[key]) == 2 and all(ms > 0 for ms in data[key])
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 0


def test_pd_transfer_refuses_a_partial_chunk():
    run = subprocess.run([sys.executable, "-m", "kvtier.bench.cli", "pd-transfer", "--prompt-len", "1000"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--prompt-len" in run.stderr
