"""Helpers for the end-to-end tests: run an engine in its own process, make prompts."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
VOCAB = 512


def run_engine(spec: dict, tmp_path: Path, name: str, env: dict | None = None) -> tuple[list, str]:
    """Run ``engine_run.py`` with ``spec``; returns (rounds, stderr+stdout log)."""
    spec_file = tmp_path / f"{name}.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_run.py"), str(spec_file)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine {name} failed:\n{log[-4000:]}"
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[7:])["rounds"], log


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]
