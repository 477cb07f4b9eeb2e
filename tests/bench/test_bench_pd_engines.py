"""``kvtier-bench pd-engines`` without engines: its table, rates, plot and argument errors, on a
result of the shape a run writes (the engines themselves run on a GPU: tests/gpu/test_gpu_pd.py
drives the same engine processes)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from kvtier.bench import pd_engines

ROOT = Path(__file__).resolve().parents[2]


def _result(failures=()) -> dict:
    ms = {row: {"8192": []} for row in pd_engines.ROWS}
    d_leg = {row: {"8192": []} for row in pd_engines.ROWS}
    ms["recompute"]["8192"] = [230.0, 240.0]
    ms["local hit"]["8192"] = [100.0, 100.0]
    ms["kvtier pull nixl"]["8192"], d_leg["kvtier pull nixl"]["8192"] = [550.0], [300.0]
    ms["kvtier push nixl"]["8192"], d_leg["kvtier push nixl"]["8192"] = [500.0], [500.0]
    return {"lengths": [8192], "repeats": 2, "kv_bytes_per_token": 128 << 10, "chunk_tokens": 256, "ttft_ms": ms,
            "d_leg_ms": d_leg, "start_s": {"kvtier P": 60.0}, "transport_lines": ["kvtier-D-nixl: ... over NIXL"],
            "failures": list(failures), "device": "GPU", "vllm": "0.26.0"}


def test_pull_rate_is_kv_bytes_over_the_d_leg_beyond_a_local_hit():
    result = _result()
    assert abs(pd_engines.transfer_gbps(result, "kvtier pull nixl", "8192") - 8192 * (128 << 10) / 0.2 / 1e9) < 1e-6
    assert pd_engines.transfer_gbps(result, "kvtier push nixl", "8192") is None  # its D leg includes P's prefill
    assert pd_engines.transfer_gbps(result, "kvtier pull zmq", "8192") is None  # not run


def test_table_shows_rows_run_and_says_whether_every_answer_loaded(tmp_path):
    table = pd_engines.format_table(_result())
    assert "kvtier pull nixl" in table and "NixlConnector pull" not in table and ": yes" in table
    assert "NO: kvtier pull nixl 8192: D loaded 0" in pd_engines.format_table(
        _result(["kvtier pull nixl 8192: D loaded 0 of 8192 tokens (expected >= 7936)"]))
    if importlib.util.find_spec("matplotlib") is not None:
        png = tmp_path / "pd.png"
        assert pd_engines.write_plot(_result(), str(png)) is None and png.stat().st_size > 0


def test_unknown_pair_is_refused_naming_the_flag():
    run = subprocess.run([sys.executable, "-m", "kvtier.bench.cli", "pd-engines", "--pairs", "kvtier,lmcache"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--pairs" in run.stderr
