"""Helpers for the end-to-end tests: run an engine in its own process, or keep one up
(:class:`StandingEngine`, ``pd_engine.py``), make prompts."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from servers import start_group

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


class StandingEngine:
    """An engine process that stays up (``pd_engine.py``), started at once: ``ready`` waits until it
    says so; ``ask`` sends one request and waits for its answer."""

    def __init__(self, spec: dict, tmp: Path, name: str):
        cores = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if spec.get("tp", 1) == 2 else {}
        (tmp / f"{name}.json").write_text(json.dumps(spec))
        self.log = tmp / f"{name}.log"
        self.printed: list[str] = []
        self.proc = start_group([sys.executable, str(HERE / "pd_engine.py"), str(tmp / f"{name}.json")],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "wb"),
                                text=True, env={**os.environ, **cores})

    def ready(self) -> None:
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
            self.printed.append(line)  # kvtier's own log lines come out here
        raise AssertionError(f"engine exited:\n{self.log.read_text(errors='replace')[-4000:]}")

    def ask(self, prompt_ids: list[int], max_tokens: int, params: dict | None = None, salt: str | None = None) -> dict:
        request = {"prompt": prompt_ids, "max_tokens": max_tokens, "params": params, "salt": salt}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("OUT "))

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
