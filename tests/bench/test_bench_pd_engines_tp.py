"""``kvtier-bench pd-engines --tp``: P's and D's sizes apart (``--tp 2:1``) or together
(``--tp 2``), the devices they take, each engine's size, the pairs run at unequal sizes, and what
the result and table say of them; against stand-in engines."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from pd_engines_fakes import ROOT, FakeEngine, fabricated_result, stand_in_run

from kvtier.bench import pd_engines
from kvtier.bench.cli import build_parser
from kvtier.bench.pd_tp import TpSizes, pair_skipped, parse_devices, result_tp


def _refused(argv: list[str], capsys) -> str:
    """The error of ``kvtier-bench pd-engines ARGV`` (exit status 2), from parsing or the checks
    the command makes before any engine starts."""
    with pytest.raises(SystemExit) as exit_:
        args = build_parser().parse_args(["pd-engines", *argv])
        args.run(args.parser, args)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_tp_takes_p_and_d_apart_or_one_size_for_both(capsys):
    assert build_parser().parse_args(["pd-engines", "--tp", "2:1"]).tp == TpSizes(2, 1)
    assert build_parser().parse_args(["pd-engines", "--tp", "2"]).tp == TpSizes(2, 2)
    assert build_parser().parse_args(["pd-engines"]).tp == TpSizes(1, 1)
    for bad in ("0:1", "a:b", "1:2:3", "0", "2:", ":1", "-1"):
        err = _refused(["--tp", bad], capsys)
        assert "argument --tp" in err and "P:D" in err, (bad, err)


def test_devices_are_p_s_then_d_s_at_each_size(capsys):
    assert parse_devices("0,1,2", TpSizes(2, 1)) == ("0,1", "2")
    assert parse_devices("0,1,2", TpSizes(1, 2)) == ("0", "1,2")
    assert parse_devices("0,1,2,3", 2) == ("0,1", "2,3")
    assert parse_devices("0,1,1", TpSizes(2, 1)) == ("0,1", "1")  # D on a GPU of P's: two GPUs do
    assert parse_devices("0,0,1", TpSizes(1, 2)) == ("0", "0,1")
    assert pd_engines.memory_share(("0,1", "1"), None) == 0.35 and pd_engines.memory_share(("0,1", "2"), None) == 0.8
    for bad in ("0,1", "0,1,2,3", "0,0,1", "0,,2"):
        with pytest.raises(ValueError, match="expected 3 devices, P's 2 then D's 1"):
            parse_devices(bad, TpSizes(2, 1))
    err = _refused(["--tp", "2:1", "--devices", "0,1"], capsys)
    assert "argument --devices: expected 3 devices, P's 2 then D's 1, like 0,1,2" in err, err
    assert "argument --tp: needs --devices" in _refused(["--tp", "2:1"], capsys)


def test_at_tp_2_the_devices_are_p_s_two_then_d_s_two_and_each_engine_runs_at_tp_2(tmp_path, monkeypatch):
    for bad in ("0,1", "0,1,2", "0,1,1,2", "0,,2,3"):
        with pytest.raises(ValueError, match="expected 4 devices"):
            pd_engines.parse_devices(bad, 2)
    assert pd_engines.engine_env("D", ("0,1", "2,3")) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert pd_engines.memory_share(("0,1", "2,3"), None) == 0.8
    run = stand_in_run(tmp_path, monkeypatch, devices=("0,1", "2,3"), tp=TpSizes(2, 2))
    assert run.spec("kvtier", role="P")["engine_args"] == run.spec("kvtier")["engine_args"] == {"tensor_parallel_size": 2}
    assert run.result()["tp"] == {"P": 2, "D": 2}
    assert "TP=2 each: P on devices 0,1, D on devices 2,3" in pd_engines.format_table({**fabricated_result(), **{
        "devices": {"P": "0,1", "D": "2,3"}, "tp": 2}})  # a result written when tp was one int


def test_tp_without_devices_is_refused_naming_the_flag():
    run = subprocess.run([sys.executable, "-m", "kvtier.bench.cli", "pd-engines", "--tp", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "argument --tp: needs --devices" in run.stderr, run.stderr


def _d_loads_nothing(monkeypatch) -> None:
    """Stand-in Ds that recompute every prompt (kvtier's D at a TP size other than P's)."""
    plain = FakeEngine.receive

    def receive(self):
        out = plain(self)
        return {**out, "cached": 0} if self.role == "D" else out

    monkeypatch.setattr(FakeEngine, "receive", receive)


def test_at_2_to_1_each_engine_runs_at_its_size_and_d_gets_p_s(tmp_path, monkeypatch):
    run = stand_in_run(tmp_path, monkeypatch, devices=("0,1", "2"), tp=TpSizes(2, 1))
    run.kvtier_pair(str(tmp_path))
    p, d_nixl, _ = FakeEngine.started
    assert p.spec["engine_args"] == {"tensor_parallel_size": 2} and d_nixl.spec["engine_args"] == {}
    assert (p.env["CUDA_VISIBLE_DEVICES"], d_nixl.env["CUDA_VISIBLE_DEVICES"]) == ("0,1", "2")
    pushes = [params for params, _ in d_nixl.sent if params and "tp_size" in params]
    assert pushes and all(params["tp_size"] == 2 for params in pushes)  # P's size, as P's answer gives it
    assert run.push_legs("1", "t", 5800, run.tp.p)[1]["tp_size"] == 2
    result = json.loads((tmp_path / "pd.json").read_text())
    assert result["tp"] == {"P": 2, "D": 1} and result_tp(result) == TpSizes(2, 1)
    assert result["d_loaded_tokens"]["kvtier pull hbm"]["600"] == [599, 599] and not result["failures"]


def test_a_kvtier_d_that_recomputes_at_unequal_sizes_is_shown_so_not_failed(tmp_path, monkeypatch):
    _d_loads_nothing(monkeypatch)
    run = stand_in_run(tmp_path, monkeypatch, devices=("0,1", "2"), tp=TpSizes(2, 1))
    run.kvtier_pair(str(tmp_path))
    result = run.result()
    assert not result["failures"] and result["d_loaded_tokens"]["kvtier push nixl"]["600"] == [0, 0]
    assert pd_engines.transfer_gbps(result, "kvtier pull hbm", "600") is None  # a recompute moved no KV
    table = pd_engines.format_table(result)
    assert "P at TP=2 on devices 0,1, D at TP=1 on devices 2 (" in table
    assert re.search(r"\nkvtier pull hbm .*  none: D recomputed\n", table)
    assert ("\nP at TP=2, D at TP=1: kvtier's D loaded nothing from P and recomputed every prompt in kvtier pull hbm, "
            "kvtier pull after lease, kvtier push nixl, kvtier pull zmq, kvtier push zmq (D's log says why); their "
            "TTFT is a recompute's\n") in table
    assert "matched P's first token: yes; the rows that recomputed loaded nothing" in table
    # At equal sizes a D that loaded nothing failed.
    (tmp_path / "equal").mkdir()
    equal = stand_in_run(tmp_path / "equal", monkeypatch, devices=("0,1", "2,3"), tp=TpSizes(2, 2))
    equal.kvtier_pair(str(tmp_path))
    assert equal.failures and "D loaded 0 of 600 tokens" in equal.failures[0]
    table = pd_engines.format_table(equal.result())
    assert "kvtier's D loaded nothing from P" not in table and "matched P's first token: NO: " in table


def test_at_unequal_sizes_the_push_pair_is_skipped_in_one_line_and_the_pull_pair_runs(tmp_path, monkeypatch):
    run = stand_in_run(tmp_path, monkeypatch, devices=("0,1", "2"), tp=TpSizes(2, 1))
    run.nixl_pair(str(tmp_path), "nixl-push")
    assert FakeEngine.started == []
    run.nixl_pair(str(tmp_path))
    p, d = FakeEngine.started
    assert p.spec["engine_args"] == {"tensor_parallel_size": 2} and d.spec["engine_args"] == {}
    table = pd_engines.format_table(run.result())
    assert re.search(r"\nNixlPushConnector push +skipped: P at TP=2, D at TP=1: NixlPushConnector is run only at "
                     r"equal TP sizes\n", table)
    assert re.search(r"\nNixlConnector pull +\d+ ", table)
    assert pair_skipped("nixl", TpSizes(1, 4)) is None and pair_skipped("kvtier", TpSizes(3, 2)) is None
    assert pair_skipped("nixl", TpSizes(3, 2)) == "P at TP=3, D at TP=2: vLLM's NixlConnector needs one TP size to divide the other"
    assert pair_skipped("nixl-push", TpSizes(2, 2)) is None
