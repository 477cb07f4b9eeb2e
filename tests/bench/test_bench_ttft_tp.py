"""``kvtier-bench ttft --tp``'s pairs, ratios and table (kvtier.bench.ttft_tp), without engines: the
engines' run is the bench itself (docs/performance.md), too slow for the suite at TP=2 on two cores."""

from __future__ import annotations

import argparse

import pytest

from kvtier.bench import ttft_tp
from kvtier.bench.pd_tp import TpSizes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier-bench ttft")
    p.exit_on_error = False
    return p


def test_each_cross_pair_gets_its_readers_same_tp_pair():
    assert ttft_tp.parse_pairs(parser(), "1:2,2:1", 4) == [TpSizes(2, 2), TpSizes(1, 1), TpSizes(1, 2), TpSizes(2, 1)]
    assert ttft_tp.parse_pairs(parser(), "2:2,1:2", 4) == [TpSizes(2, 2), TpSizes(1, 2)]


@pytest.mark.parametrize("text, words", [("3:1", "TP=3 does not divide the model's 4 KV heads"),
                                         ("1:x", "expected N"), (",", "expected pairs W:R")])
def test_bad_pairs_name_the_flag(text, words, capsys):
    with pytest.raises(SystemExit):
        ttft_tp.parse_pairs(parser(), text, 4)
    err = capsys.readouterr().err
    assert "argument --tp" in err and words in err


def test_a_cross_pair_is_read_against_its_readers_same_tp_pair():
    result = {"lengths": [8192], "repeats": 3, "identical": {"2:2": True, "1:2": False},
              "ms": {"2:2": {8192: [60.0, 50.0, 70.0]}, "1:2": {8192: [120.0, 130.0, 110.0]}},
              "loaded": {"2:2": {8192: [8192] * 3}, "1:2": {8192: [8192] * 3}}}
    result["ratio"] = ttft_tp.ratios(result)
    assert result["ratio"] == {"1:2": {8192: 2.0}}
    table = ttft_tp.format_table(result)
    assert "1:2      8192    120 / 110     2.00    8192  NO" in table
    assert "2:2      8192     60 / 50         -    8192  yes" in table


def test_the_reader_takes_the_writers_prompts_in_turns_each_writer_its_own():
    args = argparse.Namespace(repeats=3, settle_s=0.0)
    write, read = ttft_tp._rounds(args, [512], [2, 1])
    timed = [(rnd["writer"], tuple(rnd["prompts"][0])) for rnd in read if "timed" in rnd]
    assert [w for w, _ in timed] == [2, 1, 1, 2, 2, 1]  # the order turns each repeat
    for w in (1, 2):  # what the reader times of each writer is what that writer computed, and nobody else
        written = {tuple(rnd["prompts"][0]) for rnd in write[w]}
        assert {p for v, p in timed if v == w} <= written
        assert not {p for v, p in timed if v != w} & written
    checks = [(rnd["writer"], tuple(rnd["prompts"][0])) for rnd in read if "check" in rnd]
    again = [(rnd["writer"], tuple(rnd["prompts"][0])) for rnd in read if "recompute" in rnd]
    assert checks == again and len(set(checks)) == 2  # each writer's check prompt, recomputed under another salt
    assert all(rnd.get("salt") == "recompute" for rnd in read if "recompute" in rnd)
