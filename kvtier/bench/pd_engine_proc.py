"""One engine process of ``kvtier-bench pd-engines`` (:mod:`kvtier.bench.pd_child`): its start,
its request lines, its log, and its end.

The engine runs in a process session of its own (its EngineCore and workers too), so that
:meth:`Engine.stop` ends the whole group. Its log file holds stderr and every stdout line that is
not an answer (vLLM, kvtier and UCX print there).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

from kvtier.bench.common import BenchError
from kvtier.bench.servers import start_group, stop_group

CHILD = "kvtier.bench.pd_child"
READY_TIMEOUT_S = 600.0  # one engine's start on a busy host, s
REQUEST_TIMEOUT_S = 180.0  # one request (a 32k-token P/D answer takes seconds on a GPU), s
TRANSPORT_MARK = "kvtier P/D: fetching from"  # the line a kvtier D logs per producer and transport
RELEASE_TIMEOUT_S = 30.0  # how long a stopped engine's GPU memory may take to come back, s
RELEASE_SLACK_MIB = 1024.0  # in use above the level before the engine started that still counts as back


class Engine:
    """One engine process (:mod:`kvtier.bench.pd_child`) and its request lines; ``env`` is added
    to this process's environment (e.g. ``CUDA_VISIBLE_DEVICES``)."""

    def __init__(self, name: str, spec: dict, workdir: str, env: dict | None = None):
        self.name = name
        path = os.path.join(workdir, f"{name}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.proc = start_group([sys.executable, "-m", CHILD, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=open(self.log_path, "ab"), text=True,
                                env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})})
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.start_s = json.loads(self._expect("READY ", READY_TIMEOUT_S))["start_s"]

    def _read(self) -> None:
        with open(self.log_path, "a") as log:  # vLLM and kvtier log to stdout: their lines go beside stderr's
            for line in self.proc.stdout:
                if not line.startswith(("OUT ", "READY ")):
                    log.write(line)
                    log.flush()
                self._lines.put(line)
        self._lines.put(None)

    def _expect(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchError(f"engine {self.name} gave no {prefix.strip()} line in {timeout_s:.0f} s; "
                                 f"log {self.log_path}:\n{self.log_tail()}") from None
            if line is None:
                raise BenchError(f"engine {self.name} exited (status {self.proc.wait()}); log {self.log_path}:\n"
                                 f"{self.log_tail()}")
            if line.startswith(prefix):
                return line[len(prefix):]

    def send(self, prompt: list[int], params: dict | None = None, max_tokens: int = 1, logprobs: int | None = None,
             request_id: str | None = None, profile: str | None = None) -> None:
        """Start one request (``params``: its ``kv_transfer_params``; ``request_id``: its name in
        the engine, decimal digits; ``profile``: run it under the engine's profiler, its traces
        tagged so, for an engine whose spec has a ``profile_dir``); :meth:`receive` gives the answer."""
        line = {"prompt": prompt, "params": params, "max_tokens": max_tokens, "logprobs": logprobs}
        if request_id is not None:
            line["request_id"] = request_id
        if profile is not None:
            line["profile"] = profile
        self.proc.stdin.write(json.dumps(line) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        return json.loads(self._expect("OUT ", REQUEST_TIMEOUT_S))

    def ask(self, prompt: list[int], params: dict | None = None, request_id: str | None = None,
            profile: str | None = None) -> dict:
        self.send(prompt, params, request_id=request_id, profile=profile)
        return self.receive()

    def log_text(self, start: int = 0) -> str:
        """The log from byte ``start`` on ("" when it cannot be read)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_size(self) -> int:
        """The log's length so far, bytes (0 when it cannot be read)."""
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def log_tail(self, n_chars: int = 3000) -> str:
        return self.log_text()[-n_chars:]

    def transport_lines(self, start: int = 0) -> list[str]:
        """kvtier's transport lines (:data:`TRANSPORT_MARK`) logged from byte ``start`` on."""
        return [ln.strip() for ln in self.log_text(start).splitlines() if TRANSPORT_MARK in ln]

    def stop(self) -> None:
        """End the engine's whole process group (EngineCore and workers too)."""
        stop_group(self.proc, grace_s=15)


def gpu_used_mib(device: str) -> float | None:
    """Memory in use on GPU ``device`` (``nvidia-smi``'s index; several, comma-separated: their
    sum), MiB; None where it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", device],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return sum(float(line) for line in out.split()) if out.split() else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def wait_released(device: str, before_mib: float, timeout_s: float = RELEASE_TIMEOUT_S) -> dict:
    """Once an engine on GPU ``device`` stopped: wait until the memory in use there is back to
    ``before_mib`` (what it was before the engine started), at most ``timeout_s``. Returns
    ``{"s": seconds waited, "held_mib": what was still held above that level at the end}``: a
    peer still mapping the engine's KV cache keeps it held, and the next engine there cannot start."""
    start = time.monotonic()
    while True:
        used = gpu_used_mib(device)
        held = 0.0 if used is None else max(0.0, used - before_mib)
        if held <= RELEASE_SLACK_MIB or time.monotonic() - start >= timeout_s:
            return {"s": round(time.monotonic() - start, 1), "held_mib": round(held)}
        time.sleep(0.5)
