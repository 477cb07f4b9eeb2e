"""``kvtier-bench pd-engines --py-spy DIR``: where kvtier's P and D spend a transfer's time.

py-spy (``pip install py-spy``) samples a running Python process from outside, every thread and
its children (vLLM's engine core) included, without pausing it (``--nonblocking``): the engines
run unchanged while the kvtier pair's repeats at the longest prompt length are recorded. Each
engine's samples go to ``DIR/<engine>.speedscope.json`` (open it at https://www.speedscope.app)
and :func:`summary` reads them back:

- a thread that ran remote loads (D's load executor): each load's length, and over the short
  loads (a pull, under :data:`LONG_MS`) and the long ones (a push waiting on P's prefill) apart,
  which kvtier function, waiting in which call, holds what share of the load's samples;
- a chunk server thread (P's, or D's own): the same shares over its busy samples (those not
  waiting for a message).

A sample's length is the recording's wall time over the samples taken: without pausing the
process py-spy may take fewer than its rate asks, so the milliseconds are estimates; the shares
are exact counts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

RATE = 1000  # samples per second asked of py-spy
LONG_MS = 200.0  # a remote load at least this long waited on P's prefill (a push)
TOP = 8  # lines per group
LOAD = "LoadSide._load_remote"
SERVER_THREAD = "kvtier-pd-server"
_IDLE = ("ChunkServer._serve", "Poller.poll")  # (caller, call) of a chunk server waiting for its next message


def py_spy() -> str | None:
    """The py-spy executable (on ``PATH``, else beside this Python's), or None when it is not installed."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))


class Spy:
    """py-spy recording process ``pid`` and its children into ``path`` until :meth:`stop`."""

    def __init__(self, pid: int, path: str):
        self.path = path
        self.began = time.monotonic()
        self.seconds = 0.0
        self.proc = subprocess.Popen(
            [py_spy() or "py-spy", "record", "--pid", str(pid), "--subprocesses", "--idle", "--threads",
             "--nonblocking", "--rate", str(RATE), "--format", "speedscope", "--output", path],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def stop(self) -> str | None:
        """Stop recording (py-spy writes its file then); why nothing was written, or None."""
        self.seconds = time.monotonic() - self.began
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "py-spy did not stop within 120 s"
        if os.path.exists(self.path):
            return None
        return f"py-spy wrote nothing ({(err.strip().splitlines() or ['no message'])[-1]})"


def summary(path: str, seconds: float) -> list[str]:
    """Lines on where the threads of one engine's recording (``path``, speedscope JSON of
    ``seconds`` of wall time) spent remote loads and chunk serving (see the module docstring)."""
    with open(path) as f:
        data = json.load(f)
    frames = data["shared"]["frames"]
    profiles = [p for p in data["profiles"] if p.get("samples")]
    if not profiles:
        return ["no samples"]
    ms = seconds * 1e3 / max(len(p["samples"]) for p in profiles)  # one sample, estimated
    names = [f["name"] for f in frames]
    lines = [f"{len(profiles)} threads, ~{ms:.2f} ms a sample"]
    for p in profiles:
        samples = p["samples"]
        loads = _runs([any(names[i] == LOAD for i in s) for s in samples])
        if loads:
            lengths = [(b - a) * ms for a, b in loads]
            lines.append(f"{p['name']}: {len(loads)} remote loads, ms " + ", ".join(f"{x:.0f}" for x in lengths))
            for label, keep in (("short", lambda x: x < LONG_MS), ("long", lambda x: x >= LONG_MS)):
                picked = [samples[a:b] for (a, b), x in zip(loads, lengths) if keep(x)]
                if picked:
                    lines += _shares(f"  {label} loads", [s for run in picked for s in run], frames, ms)
        if SERVER_THREAD in p["name"]:
            busy = [s for s in samples if s and tuple(names[i] for i in s[-2:]) != _IDLE]
            if busy:
                lines += _shares(f"{p['name']}: busy", busy, frames, ms)
    return lines


def _runs(flags: list[bool], gap: int = 2) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of True in ``flags``, runs less than ``gap`` samples apart joined."""
    runs: list[tuple[int, int]] = []
    for k, flag in enumerate(flags):
        if not flag:
            continue
        if runs and k - runs[-1][1] < gap:
            runs[-1] = (runs[-1][0], k + 1)
        else:
            runs.append((k, k + 1))
    return runs


def _shares(title: str, samples: list[list[int]], frames: list[dict], ms: float) -> list[str]:
    """``title`` with the samples' total, then the top (innermost kvtier function ← innermost call) shares."""
    counts: Counter = Counter()
    for stack in samples:
        ours = [i for i in stack if _ours(frames[i].get("file") or "")]
        where = frames[ours[-1]]["name"] if ours else "-"
        counts[(where, frames[stack[-1]]["name"] if stack else "-")] += 1
    lines = [f"{title}: {len(samples)} samples, ~{len(samples) * ms:.0f} ms"]
    for (where, leaf), n in counts.most_common(TOP):
        lines.append(f"    {100 * n / len(samples):5.1f} %  {where}" + (f"  <- {leaf}" if leaf != where else ""))
    return lines


def _ours(path: str) -> bool:
    """Whether a frame's file is kvtier's (installed, or in a checkout), not another package's."""
    tail = path.replace("\\", "/").split("site-packages/")[-1]
    return tail.startswith("kvtier/") or "/kvtier/" in tail
