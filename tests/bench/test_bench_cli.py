"""``kvtier-bench reload`` end to end on a tiny geometry, as a user runs it (a subprocess)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench.cli import build_parser
from kvtier.bench.common import parse_tokens

ROOT = Path(__file__).resolve().parents[2]
GEOMETRY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64"]
TINY = ["--prompt-len", "1k", *GEOMETRY]
PATHS = ("kvtier", "kvtier.ops", "kvtier.storage", "kvtier.rest", "naive", "raw")


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.bench.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("text, tokens", [("32k", 32768), ("32K", 32768), ("32768", 32768), ("4k", 4096), ("1m", 1 << 20)])
def test_prompt_len_accepts_k_suffix(text, tokens):
    assert parse_tokens(text) == tokens
    assert build_parser().parse_args(["reload", "--prompt-len", text]).prompt_len == tokens


def test_reload_writes_verified_json_and_plot(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    run = bench("reload", *TINY, "--repeats", "2", "--json", str(out), "--plot", str(png))
    assert run.returncode == 0, run.stderr
    assert "raw memcpy" in run.stdout and "save GB/s" in run.stdout
    data = json.loads(out.read_text())
    assert data["verified"] is True and "kvtier" in data["verified_paths"] and "naive" in data["verified_paths"]
    assert data["bytes"] == 1024 * 2 * (2 * 2 * 64 * 2)  # tokens x layers x (K and V x heads x dim x bf16)
    assert data["geometry"]["layers"] == 2 and data["geometry"]["prompt_tokens"] == 1024
    assert data["device"]["type"] == "cpu" and data["device"]["name"] and data["timestamp"]
    assert data["statistic"] == "best" and data["repeats"] == 2
    for name in PATHS:
        row = data["results"][name]
        for key in ("save_ms", "save_gbps", "reload_ms", "reload_gbps"):
            assert row[key] > 0, (name, key, row)
        assert len(row["save_ms_samples"]) == 2
    assert data["results"]["raw"]["save_vs_raw"] == pytest.approx(1.0)
    for candidate in ("kvtier-xxh3-128", "kvtier-crc32c", "kvtier-blake3"):  # a row per chunk checksum, verified
        assert candidate in data["verified_paths"] and data["results"][f"{candidate}.rest"]["save_ms_samples"]
    assert "KVSUM64 in the copy" in data["results"]["kvtier"]["label"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 0


def test_reload_with_cold_disk_tier(tmp_path):
    out = tmp_path / "r.json"
    run = bench("reload", *TINY, "--repeats", "1", "--disk", str(tmp_path / "disk"), "--json", str(out))
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert "disk_cold" in data["verified_paths"]
    assert data["results"]["disk_cold"]["reload_ms"] > 0 and data["results"]["disk_cold"]["save_ms"] > 0
    assert not any((tmp_path / "disk").iterdir())  # the bench deletes its chunk files


@pytest.mark.parametrize("args, flag", [
    (["--prompt-len", "12q"], "--prompt-len"),
    (["--prompt-len", "1000"], "--prompt-len"),  # not a whole number of 256-token chunks
    (["--chunk-tokens", "100"], "--chunk-tokens"),
    (["--backend", "nope"], "--backend"),
])
def test_bad_arguments_name_the_flag(args, flag):
    run = bench("reload", *GEOMETRY, *args, timeout=30)
    assert run.returncode == 2
    assert f"argument {flag}" in run.stderr, run.stderr


def test_verify_blocks_names_the_first_bad_block():
    import torch

    from kvtier.bench.common import VerifyError
    from kvtier.bench.engine_kv import Geometry, clobber_blocks, make_engine_kv, verify_blocks

    kv = make_engine_kv(Geometry(2, 2, 64, torch.bfloat16, 16), 8, torch.device("cpu"))
    clobber_blocks(kv.layout, kv.dst)
    with pytest.raises(VerifyError):
        verify_blocks(kv.layout, kv.src, kv.dst, "clobbered")
    for region in kv.layout.regions:
        region.blocks[kv.dst] = region.blocks[kv.src]
    verify_blocks(kv.layout, kv.src, kv.dst, "copied")
    kv.layout.regions[1].blocks[kv.dst[5], 3] ^= 1
    with pytest.raises(VerifyError, match=f"block {int(kv.dst[5])} differs from saved block {int(kv.src[5])}"):
        verify_blocks(kv.layout, kv.src, kv.dst, "one flipped bit")


def test_failed_verification_exits_1(monkeypatch, capsys):
    from kvtier.bench import cli, reload
    from kvtier.bench.common import VerifyError

    def corrupt(layout, src, dst, what):
        raise VerifyError(f"{what}: injected")

    monkeypatch.setattr(reload, "verify_blocks", corrupt)
    assert cli.main(["reload", *TINY, "--repeats", "1"]) == 1
    assert "VERIFICATION FAILED: kvtier reload from the CPU tier: injected" in capsys.readouterr().err
