"""The disk rows of ``kvtier-bench engine`` without a GPU: arguments, the rounds both engines run
and the JSON they make (engines faked), the file name, the table, and the page cache drop's report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import pytest

from kvtier.bench import engine_disk
from kvtier.bench.cli import build_parser
from kvtier.config import KvtierConfig
from kvtier.storage import DiskSpeed

SPEED = DiskSpeed(16 << 20, 0.01, 1, "scratch", True)


def fabricated(dropped: bool = True) -> dict:
    cache = {"dropped": dropped, "how": "drop_caches" if dropped else "fadvise", "files": 12,
             "resident_bytes": 0 if dropped else 3 << 20, "problem": None if dropped else
             "/proc/sys/vm/drop_caches not writable (Permission denied)"}
    ms = {"recompute_ms": {"8192": [400.0, 420.0, 410.0]}, "first_sight_ms": {"8192": [200.0, 190.0, 210.0]},
          "again_ms": {"8192": [50.0, 40.0, 60.0]}}
    return engine_disk.disk_result("h200", "0.33.0", [8192], 3, "direct", SPEED, cache, ms)


def test_engine_takes_the_disk_arguments():
    args = build_parser().parse_args(["engine", "--engines", "disk", "--disk-io", "direct", "--disk-results", "out"])
    assert (args.engines, args.disk_io, args.disk_results) == ("disk", "direct", "out")
    defaults = build_parser().parse_args(["engine"])
    assert (defaults.disk_io, defaults.disk_results) == ("buffered", "bench/results")


def test_both_engines_rounds_make_the_json(monkeypatch, tmp_path):
    specs = []

    def spawn(spec, workdir, name, **kw):
        specs.append((name, spec))
        rounds = [{"seconds": 0.001 * (i + 1), "outputs": [{"tokens": [1], "cached": 0, "id": f"{i}.{j}"}
                                                           for j in range(len(r["prompts"]))]}
                  for i, r in enumerate(spec["rounds"])]
        rounds[-1]["transfers"] = {"hit_tokens_cpu": 128, "hit_tokens_disk": 128}
        last = len(rounds) - 1  # the queue's: one loaded from disk, one from the CPU tier it was promoted to
        return {"rounds": rounds}, (f"kvtier: request {last}.0-ab12 loaded 8 of 8 blocks (128 tokens from disk) in 3 ms\n"
                                    f"kvtier: request {last}.1-cd34 loaded 8 of 8 blocks (128 tokens from cpu) in 1 ms\n")

    monkeypatch.setattr(engine_disk, "spawn", spawn)
    monkeypatch.setattr(engine_disk, "disk_read_speed", lambda disk, direct: SPEED)
    monkeypatch.setattr(engine_disk, "drop_page_cache", lambda path: fabricated()["page_cache"])
    monkeypatch.setattr(engine_disk, "_card", lambda tp: "h200")
    monkeypatch.setattr(engine_disk, "vllm_version", lambda: "0.33.0")
    args = argparse.Namespace(repeats=2, disk_io="direct", settle_s=0.5, tp=2, disk_dir=None, cpu_gib=4, disk_queue=2)
    prompt = lambda seed, n: [seed % 1000] * n  # noqa: E731
    read, out, result = engine_disk.run(args, [64, 128], prompt, lambda rounds, kvtier: {"rounds": rounds,
                                        "kvtier": kvtier}, str(tmp_path), lambda line: None)
    assert [name for name, _ in specs] == ["disk-write", "disk"]
    assert all(spec["kvtier"]["disk_io"] == "direct" for _, spec in specs)
    assert len(out["rounds"]) == len(read)
    for name in ("recompute_ms", "first_sight_ms", "again_ms"):
        assert sorted(result[name]) == ["128", "64"] and all(len(v) == 2 for v in result[name].values())
    again = [r for r in read if r.get("tag", [""])[0] == "again"]
    assert again and all(r["reset"] for r in again)  # a CPU-tier hit: vLLM's prefix cache emptied first
    firsts = [r["prompts"][0] for r in read if r.get("tag", [""])[0] == "disk"]
    assert firsts == [r["prompts"][0] for r in specs[0][1]["rounds"] if r.get("tag", [""])[0] == "recompute"]
    warm = [r["prompts"][0] for r in read if r.get("tag") == ["warmup"]]
    assert not set(map(tuple, warm)) & set(map(tuple, (r["prompts"][0] for r in specs[0][1]["rounds"])))
    assert result["disk_read_bytes_per_s"] == SPEED.bytes_per_s and result["page_cache"]["dropped"]
    assert result["medium"] != "unknown"  # the file system the disk tier was on
    queue = [r["prompts"] for r in read if r["tag"][0] == "queue"]
    assert len(queue) == 1 and len(queue[0]) == 2 and all(len(p) == 128 for p in queue[0])
    assert sum(r["tag"] == ["write-queue"] for r in specs[0][1]["rounds"]) == 2  # written first, by the other engine
    assert result["queue"]["tiers"] == ["disk", "cpu"] and result["queue"]["transfers"] == {"cpu": 128, "disk": 128}
    assert specs[1][1]["kvtier"]["cpu_bytes"] == 4 << 30
    assert specs[1][1]["scheduler"]  # the fresh engine runs kvtier's scheduler: its look-ahead promotes the queue
    assert "loaded from, in arrival order: disk, cpu" in engine_disk.format_table(result)
    # the writing engine ends once every chunk file it wrote is on disk: none of the write-through is lost
    last = specs[0][1]["rounds"][-1]
    assert last["until_files"]["count"] == engine_disk.chunk_files(specs[0][1]["rounds"], engine_disk.CHUNK_TOKENS) * args.tp
    assert engine_disk.CHUNK_TOKENS == next(f.default for f in dataclasses.fields(KvtierConfig) if f.name == "chunk_tokens")
    json.dumps(result)


@pytest.mark.parametrize("card, release, name", [("h200", "0.33.0", "disk-h200-v033"),
                                                 ("h100x2", "0.26.1", "disk-h100x2-v026"),
                                                 ("h200", "unknown", "disk-h200-unknown")])
def test_result_names_carry_card_and_release(card, release, name):
    assert engine_disk.result_name(card, release) == name
    assert engine_disk.result_name(card, release, "tmpfs") == name + "-tmpfs"  # a faster medium's stand-in
    assert engine_disk.result_name(card, release, "ext4") == name


def test_the_medium_is_the_file_system_of_the_longest_mount_point_above():
    assert engine_disk.medium("/proc/self") == "proc"
    assert engine_disk.medium("/") not in ("unknown", "proc")


def test_write_puts_json_and_table_side_by_side(tmp_path):
    path = engine_disk.write(fabricated(), str(tmp_path / "results"))
    assert os.path.basename(path) == "disk-h200-v033.json"
    data = json.loads(open(path).read())
    assert data["first_sight_ms"] == {"8192": [200.0, 190.0, 210.0]} and data["page_cache"]["dropped"] is True
    assert "first sight" in (tmp_path / "results" / "disk-h200-v033.txt").read_text()


def test_the_table_and_a_page_cache_not_dropped():
    text = engine_disk.format_table(fabricated())
    assert "page cache: dropped (drop_caches), 12 files" in text
    row = text.splitlines()[-1].split()
    assert row[0] == "8192" and row[1:4] == ["410", "/", "400"] and row[-1] == "0.49"  # 200 / 410
    text = engine_disk.format_table(fabricated(dropped=False))
    assert "NOT dropped: /proc/sys/vm/drop_caches not writable (Permission denied) (3.0 MiB of 12 files" in text


def test_drop_page_cache_reports_what_stays_resident(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_disk, "DROP_CACHES", str(tmp_path / "no" / "drop_caches"))  # never the machine's
    path = tmp_path / "chunks" / "a.kv"
    path.parent.mkdir()
    path.write_bytes(os.urandom(1 << 20))
    path.read_bytes()
    assert engine_disk.resident_bytes(str(path)) > 0  # just read: in the page cache
    report = engine_disk.drop_page_cache(str(tmp_path / "chunks"))
    assert report["files"] == 1 and report["how"] == "fadvise"
    assert report["dropped"] == (report["resident_bytes"] == 0)
    assert report["dropped"] or "not writable" in report["problem"]
    assert engine_disk.resident_bytes(str(path)) == report["resident_bytes"]


def test_chunk_files_counts_each_distinct_prompts_whole_chunks():
    rounds = [{"prompts": [[1] * 1024]}, {"prompts": [[1] * 1024]}, {"prompts": [[2] * 600, [3] * 256]}]
    assert engine_disk.chunk_files(rounds, 256) == 4 + 2 + 1  # the repeated prompt once; 600 tokens: 2 whole chunks


def test_the_engine_child_waits_for_a_directory_of_whole_files(tmp_path):
    from kvtier.bench.engine_child import wait_for_files

    (tmp_path / "a").write_bytes(b"x" * 8)
    (tmp_path / "b").write_bytes(b"x" * 3)  # still being written
    assert wait_for_files(str(tmp_path), 2, 0.3)["landed"] is False
    (tmp_path / "b").write_bytes(b"x" * 8)
    found = wait_for_files(str(tmp_path), 2, 5)
    assert found["landed"] and found["files"] == 2 and found["sizes"] == 1 and not found["stalled"]


def test_the_engine_child_stops_waiting_once_no_file_comes_any_more(tmp_path):
    """Files the tier evicted never come back: the wait ends once nothing changed for ``stall_s``."""
    from kvtier.bench.engine_child import wait_for_files

    (tmp_path / "a").write_bytes(b"x" * 8)
    begin = time.monotonic()
    found = wait_for_files(str(tmp_path), 3, timeout_s=60, stall_s=0.5)
    assert found["stalled"] and not found["landed"] and found["files"] == 1
    assert time.monotonic() - begin < 10  # not the 60 s timeout
