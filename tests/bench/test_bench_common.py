"""The benches' shared command-line parsing and progress lines (:mod:`kvtier.bench.common`)."""

from __future__ import annotations

import argparse

import pytest

from kvtier.bench.common import Progress, names_from, positive, token_lengths, token_list


def test_token_list_reads_counts_with_suffixes():
    assert token_list("2k,8k") == (2048, 8192)
    assert token_list(" 300 , 1m ,") == (300, 1 << 20)
    for bad in ("", ",", "2k,x", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            token_list(bad)


def test_positive_refuses_zero_and_words():
    assert positive("3") == 3
    for bad in ("0", "-1", "three"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive(bad)


@pytest.mark.parametrize("text, message", [("8k,q", "argument --prompt-lens: expected a positive token count"),
                                           (",", "argument --prompt-lens: give at least one length")])
def test_token_lengths_stops_the_command_naming_the_flag(text, message, capsys):
    parser = argparse.ArgumentParser(prog="kvtier-bench x")
    assert token_lengths(parser, "8k,32k") == [8192, 32768]
    with pytest.raises(SystemExit):
        token_lengths(parser, text)
    assert message in capsys.readouterr().err


def test_names_from_accepts_only_the_allowed(capsys):
    parser = argparse.ArgumentParser(prog="kvtier-bench x")
    assert names_from(parser, "a, b", ("a", "b", "c")) == ["a", "b"]
    with pytest.raises(SystemExit):
        names_from(parser, "a,d", ("a", "b"))
    assert "argument --engines: choose from a, b." in capsys.readouterr().err


def test_progress_lines_name_the_bench(capsys):
    Progress()("plain")
    Progress("soak")("named")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("kvtier-bench [") and err[0].endswith("s] plain")
    assert err[1].startswith("kvtier-bench soak [") and err[1].endswith("s] named")
