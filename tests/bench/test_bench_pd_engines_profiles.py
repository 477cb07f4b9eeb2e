"""``kvtier-bench pd-engines --py-spy`` and ``--profile`` against stand-in engines: when the
recordings start and stop, what D's profiled requests are, and the summaries of made-up
recordings and traces (py-spy and vLLM's profiler need real engines)."""

from __future__ import annotations

import argparse
import json
import re
import types
from pathlib import Path

import pytest
from pd_engines_fakes import FakeEngine, stand_in_run

from kvtier.bench import pd_engines, pd_engines_report, pd_engines_rows, pd_profile


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A :class:`Run` over stand-in engines, P and D on devices 0 and 1, P's lease 2000 ms."""
    return stand_in_run(tmp_path, monkeypatch)


def _two_lengths(run) -> None:
    """``run`` at 300 and 600 tokens (the longest prompt's repeats come last)."""
    run.lengths = [300, 600]
    run.ms = {row: {"300": [], "600": []} for row in run.ms}
    run.d_leg_ms = {row: {"300": [], "600": []} for row in run.d_leg_ms}
    run.loaded = {row: {"300": [], "600": []} for row in run.loaded}


def test_py_spy_records_kvtier_p_and_d_through_the_longest_prompts_repeats(run, tmp_path, monkeypatch):
    """A stand-in for py-spy (which samples real processes): recording starts before the longest
    length's first repeat and stops after its last, on P and the first D only; the summaries go in
    the result and DIR/summary.txt."""
    spied = []

    class FakeSpy:
        def __init__(self, pid, path):
            self.path, self.seconds = path, 1.0
            spied.append((pid, Path(path).name, len(FakeEngine.started[-1].sent)))

        def stop(self):
            Path(self.path).write_text(json.dumps(SPEEDSCOPE))
            return None

    monkeypatch.setattr(pd_engines_rows, "Spy", FakeSpy)
    run.args.py_spy = str(tmp_path / "spy")
    _two_lengths(run)
    run.kvtier_pair(str(tmp_path))
    p, d_nixl, _ = FakeEngine.started
    assert [(pid, name) for pid, name, _ in spied] == [(p.proc.pid, "kvtier-P.speedscope.json"),
                                                        (d_nixl.proc.pid, "kvtier-D-nixl.speedscope.json")]
    assert spied[1][2] == 1 + 2 * 3  # D had answered the warm-up and the 300-token repeats (3 rows each)
    text = (tmp_path / "spy" / "summary.txt").read_text()
    assert "== kvtier-P" in text and "== kvtier-D-nixl" in text and "2 remote loads" in text
    assert set(run.result()["py_spy"]) == {"kvtier-P", "kvtier-D-nixl"}


def test_profile_runs_one_more_pull_and_push_on_d_untimed_and_says_what_grew(run, tmp_path):
    """Stand-in engines write made-up traces (the profiler needs a CUDA vLLM): only the D over NIXL
    gets a profile_dir; after the longest prompt's repeats it answers one pull and one push under
    the profiler, neither recorded; the summary says what took longer from the load seen on after
    the push."""
    run.args.profile = str(tmp_path / "prof")
    _two_lengths(run)
    run.kvtier_pair(str(tmp_path))
    p, d_nixl, d_zmq = FakeEngine.started
    assert d_nixl.spec["profile_dir"] == str(tmp_path / "prof" / "kvtier-D")
    assert "profile_dir" not in p.spec and "profile_dir" not in d_zmq.spec
    result = run.result()
    assert [len(result["ttft_ms"][row]["600"]) for row in ("kvtier pull hbm", "kvtier push nixl")] == [2, 2]
    assert len(d_nixl.sent) == 1 + 2 * 3 * 2 + 2  # warm-up, 3 rows a repeat at both lengths, then the two profiled
    profile = result["d_profile"]
    assert set(profile["traces"]) == {"pull", "push"} and profile["summaries"]["push"][0]["span_ms"] == 40.1
    text = (tmp_path / "prof" / "summary.txt").read_text()
    assert "after a push against after a pull HBM" in text and "grew gpu:flash_fwd: 17.0 / 13.0" in text
    assert "early wait" not in text  # before the load was seen
    assert "grew gpu:flash_fwd" in pd_engines_report.format_table(result)


def test_a_profile_counts_from_the_load_seen_before_the_first_working_step_else_its_last_40_ms():
    x = {"ph": "X", "dur": 10}
    events = [{**x, "name": "kvtier.update_connector_output", "ts": 100}, {**x, "name": "kvtier.update_connector_output", "ts": 500},
              {**x, "name": pd_profile.IDLE_STEP, "ts": 600}, {**x, "name": "execute_context_1(1)_generation_0(0)", "ts": 900},
              {**x, "name": "kvtier.update_connector_output", "ts": 80_000}]
    assert pd_profile.from_load_seen(events) == 500  # not the one after the step
    assert pd_profile.from_load_seen(events[:3] + events[4:]) == 80_010 - 40_000  # no working step: the last 40 ms


def test_a_profile_without_traces_says_so_in_a_summary_of_its_own(tmp_path):
    """vLLM wrote no trace (e.g. a profiler that failed to start): the summary says so, no error."""
    answer = {"tokens": [7], "traces": None}
    run = types.SimpleNamespace(args=argparse.Namespace(profile=str(tmp_path / "none")), progress=lambda msg: None,
                                pull=lambda *a, **k: answer, push=lambda *a, **k: answer)
    profile = pd_profile.profile_d(run, None, None, 600, [])
    assert profile["traces"] == {"pull": [], "push": []}
    assert (tmp_path / "none" / "summary.txt").read_text().startswith("profile of D: no traces")


# A recording of two threads, 10 ms a sample: a load thread that ran a pull (3 samples: the
# handshake, the READ twice) and a push (25 samples waiting for replies), and a chunk server idle
# but for 2 samples answering a fetch.
_FRAMES = [{"name": n, "file": f} for n, f in (
    ("Thread.run", "threading.py"), ("LoadSide._load_remote", "/x/kvtier/transfer/load.py"),
    ("Connection.hello", "/x/kvtier/pd/consumer/connection.py"), ("Poller.poll", "zmq/sugar/poll.py"),
    ("Transfer.wait", "/x/kvtier/pd/nixl.py"), ("Connection.receive", "/x/kvtier/pd/consumer/connection.py"),
    ("ChunkServer._serve", "/x/kvtier/pd/producer/server.py"), ("ChunkServer._fetch", "/x/kvtier/pd/producer/server.py"))]
_IDLE = [[0]]
_PULL = [[0, 1, 2, 3], [0, 1, 4], [0, 1, 4]]
_PUSH = [[0, 1, 5, 3]] * 25
SPEEDSCOPE = {"shared": {"frames": _FRAMES}, "profiles": [
    {"name": 'Thread 1 "kvtier-remote_0"', "samples": _IDLE * 5 + _PULL + _IDLE * 5 + _PUSH + _IDLE * 2},
    {"name": 'Thread 2 "kvtier-pd-server"', "samples": [[0, 6, 3]] * 38 + [[0, 6, 7]] * 2}]}


def test_the_py_spy_summary_says_where_loads_and_chunk_serving_went(tmp_path):
    from kvtier.bench.pd_spy import summary

    path = tmp_path / "d.json"
    path.write_text(json.dumps(SPEEDSCOPE))
    lines = summary(str(path), seconds=0.4)  # 40 samples
    text = "\n".join(lines)
    assert lines[0] == "2 threads, ~10.00 ms a sample"
    assert 'kvtier-remote_0": 2 remote loads, ms 30, 250' in text
    assert re.search(r"short loads: 3 samples, ~30 ms\n +66.7 %  Transfer.wait\n +33.3 %  Connection.hello  <- Poller.poll", text)
    assert re.search(r"long loads: 25 samples, ~250 ms\n +100.0 %  Connection.receive  <- Poller.poll", text)
    assert re.search(r'kvtier-pd-server": busy: 2 samples, ~20 ms\n +100.0 %  ChunkServer._fetch', text)


def test_py_spy_that_is_not_installed_is_refused_naming_the_flag(tmp_path, monkeypatch, capsys):
    from kvtier.bench.cli import build_parser

    monkeypatch.setattr(pd_engines, "py_spy", lambda: None)  # make test installs it
    args = build_parser().parse_args(["pd-engines", "--py-spy", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        args.run(args.parser, args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--py-spy" in err and "pip install py-spy" in err, err
