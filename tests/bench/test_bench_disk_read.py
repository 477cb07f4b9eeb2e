"""``kvtier-bench disk-read``: its arguments, its table from a fabricated result, and a small run
on a real directory (one where O_DIRECT works; skipped where none does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvtier.bench.cli import build_parser
from kvtier.bench.disk_read import ROWS, format_table

ROOT = Path(__file__).resolve().parents[2]


def test_arguments_and_their_defaults():
    args = build_parser().parse_args(["disk-read", "--dir", "/d"])
    assert (args.dir, args.chunk_mib, args.chunks, args.repeats, args.json, args.plot) == ("/d", 32, 16, 3, None, None)


def test_the_table_puts_each_row_against_sequential_reads():
    rows = {name: {"label": label, "bytes_per_s": [1e9, 2e9, 3e9] if name == "sequential" else [4e9, 3e9, 5e9]}
            for name, label in ROWS.items()}
    result = {"chunks": 16, "chunk_bytes": 32 << 20, "dir": "/nvme", "threads": 8, "part_bytes": 4 << 20,
              "repeats": 3, "rows": rows}
    lines = format_table(result).splitlines()
    assert "16 chunks of 33554432 bytes in /nvme" in lines[0] and "8 threads, parts of 4 MiB" in lines[0]
    seq = next(line for line in lines if line.startswith("sequential O_DIRECT"))
    assert seq.split()[-4:] == ["3.00", "2.00", "16.8", "1.00"]  # best, median GB/s, ms per chunk, x seq
    load = next(line for line in lines if line.startswith("a load (read-ahead)"))
    assert load.split()[-4:] == ["5.00", "4.00", "8.4", "2.00"]


def test_a_small_run_writes_json_and_leaves_nothing(direct_dir):
    out = direct_dir / "r.json"
    run = subprocess.run([sys.executable, "-m", "kvtier.bench.cli", "disk-read", "--dir", str(direct_dir),
                          "--chunks", "3", "--chunk-mib", "1", "--repeats", "1", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LMCACHE_LOG_LEVEL": "ERROR"})
    assert run.returncode == 0, run.stderr
    assert "a load (read-ahead)" in run.stdout and "x seq" in run.stdout
    data = json.loads(out.read_text())
    assert data["chunk_bytes"] == (1 << 20) + 64 and data["chunks"] == 3
    assert set(data["rows"]) == set(ROWS) and all(r["bytes_per_s"][0] > 0 for r in data["rows"].values())
    assert sorted(p.name for p in direct_dir.iterdir()) == ["r.json"]  # its directory and files are gone
