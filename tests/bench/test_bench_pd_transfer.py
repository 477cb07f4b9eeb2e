"""``kvtier-bench pd-transfer`` end to end on a small geometry, as a user runs it (a subprocess), with
P and D of other TP sizes beside the default pair (``--tp``); its arguments and table in process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench.cli import build_parser
from kvtier.bench.pd_tp import TpSizes
from kvtier.bench.pd_transfer import PdTransferResult, format_table
from kvtier.bench.pd_transfer_tp import TpTransferResult, fetched_bytes

ROOT = Path(__file__).resolve().parents[2]


def test_pd_transfer_verifies_and_writes_json_and_plot(tmp_path):
    """The default pair's rows and, in the same run (one start of the producer), TP 1→1, 2→1 and 1→2."""
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    run = subprocess.run([sys.executable, "-m", "kvtier.bench.cli", "pd-transfer", "--prompt-len", "1k",
                          "--layers", "2", "--repeats", "2", "--tp", "1:1,2:1,1:2", "--json", str(out),
                          "--plot", str(png)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for row in ("raw ZMQ", "raw NIXL READ", "kvtier over ZMQ", "kvtier over NIXL, pull", "kvtier over NIXL, push",
                "kvtier zmq, TP 2→1", "kvtier nixl, TP 1→2"):
        assert row in run.stdout, run.stdout
    data = json.loads(out.read_text())
    kv_bytes = 1024 * 2 * 2 * 4 * 64 * 4  # tokens x layers x (K, V) x heads x dim x float32
    assert data["kv_bytes"] == kv_bytes
    for key in ("memcpy_ms", "zmq_ms", "kvtier_ms", "nixl_ms", "kvtier_nixl_ms", "kvtier_push_ms"):
        assert len(data[key]) == 2 and all(ms > 0 for ms in data[key])
    pairs = [(r["tp"]["P"], r["tp"]["D"], r["transport"]) for r in data["tp_pairs"]]
    assert pairs == [(p, d, t) for t in ("zmq", "nixl") for p, d in ((1, 1), (2, 1), (1, 2))]
    for r in data["tp_pairs"]:
        assert r["kv_bytes"] == kv_bytes and len(r["kvtier_ms"]) == 2 and all(ms > 0 for ms in r["kvtier_ms"])
        assert r["verified"] == 3  # the warm-up and both repeats: D's blocks matched P's byte for byte
        assert r["fetched_bytes"] == kv_bytes  # P cuts each D rank's heads out of its wider pieces
        cuts = r["tp"]["P"] < r["tp"]["D"]  # P's time cutting, for each timed sample where it cuts
        assert len(r["p_cut_ms"]) == (2 if cuts else 0) and all(ms > 0 for ms in r["p_cut_ms"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 0


def test_pd_transfer_refuses_a_partial_chunk():
    run = subprocess.run([sys.executable, "-m", "kvtier.bench.cli", "pd-transfer", "--prompt-len", "1000"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--prompt-len" in run.stderr


def _refused(argv: list[str], capsys) -> str:
    """The error of ``kvtier-bench pd-transfer ARGV`` (exit status 2), before anything starts."""
    with pytest.raises(SystemExit) as exit_:
        args = build_parser().parse_args(["pd-transfer", *argv])
        args.run(args.parser, args)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_tp_takes_pairs_each_once_and_refuses_bad_ones(capsys):
    parse = lambda *argv: build_parser().parse_args(["pd-transfer", *argv]).tp  # noqa: E731
    assert parse() == (TpSizes(1, 1),)
    assert parse("--tp", "1:1,2:1, 1:2,2") == (TpSizes(1, 1), TpSizes(2, 1), TpSizes(1, 2), TpSizes(2, 2))
    assert parse("--tp", "2:1,2:1") == (TpSizes(2, 1),)
    for bad in ("0:1", "a:b", "1:2:3", "1:1,,2:1", "1:1,", "", "-1"):
        err = _refused(["--tp", bad], capsys)
        assert "argument --tp" in err and "P:D" in err, (bad, err)
    err = _refused(["--tp", "1:1,3:1", "--kv-heads", "4"], capsys)
    assert "argument --tp: TP sizes must divide --kv-heads 4; 3:1 does not" in err, err
    assert "8:8, 1:8 do not" in _refused(["--tp", "8,1:8,2:1"], capsys)  # the default 4 KV heads


def test_fetched_bytes_counts_each_head_once_unless_a_rank_straddles_two_pieces():
    assert [fetched_bytes(100, 4, TpSizes(p, d)) for p, d in ((1, 1), (2, 1), (4, 2), (1, 2), (1, 4), (2, 4))] == \
        [100, 100, 100, 100, 100, 100]
    assert fetched_bytes(600, 6, TpSizes(2, 3)) == 200 + 600 + 200  # D's middle rank reads both of P's pieces whole


def test_the_table_gives_each_pair_its_ratio_to_the_same_tp_pair_of_d_s_size():
    pairs = [TpTransferResult(TpSizes(p, d), "zmq", 2 << 20, 2 << 20, ms, 3, cut)
             for p, d, ms, cut in ((1, 1, [10.0, 12.0, 11.0], []), (2, 1, [30.0, 33.0, 36.0], []),
                                   (1, 2, [20.0, 20.0, 20.0], [5.0, 9.0, 7.0]))]
    result = PdTransferResult(512, 256, 2 << 20, [1.0], [2.0], [4.0], [], [], [], pairs)
    table = format_table(result, "best")
    lines = {line.split("  ")[0]: line.split() for line in table.splitlines()}
    assert lines["kvtier zmq, TP 1→1"][-6:] == ["2", "11.0", "10.0", "0.19", "1.00", "-"]
    assert lines["kvtier zmq, TP 2→1"][-6:] == ["2", "33.0", "30.0", "0.06", "3.00", "-"]
    assert lines["kvtier zmq, TP 1→2"][-2:] == ["-", "7.0"]  # no TP 2→2 ran; P's cuts, median ms
    default = format_table(PdTransferResult(512, 256, 2 << 20, [1.0], [2.0], [4.0], [], [], []), "best")
    assert "TP" not in default and default == table.split("\n\n")[0]
