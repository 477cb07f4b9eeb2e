"""Where an engine's thread spends its CPU, from a py-spy record of a bench: the engine loop and,
inside it, each KV connector hook.

vLLM's torch profiler (``kvtier-bench engine --profile``) slows a busy round about 3 ×; a sampling
profiler from outside the process barely does. Record a bench under py-spy (every thread, idle
samples left out, raw collapsed stacks), then summarize::

    py-spy record --subprocesses --threads --nonblocking -r 100 -f raw -o chat.txt -- \\
        kvtier-bench engine --tp 1 --engines kvtier --cpu-gib 40 --busy-only --sessions 32 ...
    python -m kvtier.bench.engine_spy chat.txt [--json chat.json]

Each line of a raw record is ``frame;frame;...;frame count``: the processes from the outermost,
then ``thread (tid): name``, then the Python frames from the outermost, each ``function (path:line)``.
A sample is in the *engine loop* when a frame is one of vLLM's engine-core step functions
(:data:`LOOP`); a loop sample is in a *hook* when a frame belongs to the connector's module
(:data:`CONNECTORS`), and the hook is that frame's function. Samples count CPU time only: time
the engine's thread waits (for the GPU, for a load) is left out by ``py-spy`` (``--idle`` keeps it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

# vLLM's engine-core step functions: the busy loop of a separate engine process, the in-process step
LOOP = ("run_busy_loop (", "step_with_batch_queue (", "step (")
LOOP_FILE = "vllm/v1/engine/core.py"
# the connector's own module, per connector: its hook functions are the frames there
CONNECTORS = {"kvtier": "kvtier/engines/vllm/connector.py",
              "OffloadingConnector": "kv_connector/v1/offloading_connector.py",
              "NixlConnector": "kv_connector/v1/nixl_connector.py"}
_FRAME = re.compile(r"^(?P<function>.+?) \((?P<path>.+?):(?P<line>\d+)\)$")


@dataclass
class SpySummary:
    """Samples (at the record's rate, e.g. 100 a second) of one record."""

    samples: int = 0  # every sample of every process
    loop: int = 0  # on an engine loop's thread, inside its step
    hooks: dict[str, Counter] = field(default_factory=dict)  # connector -> hook function -> loop samples
    threads: Counter = field(default_factory=Counter)  # thread name -> samples (every process)

    def hook_samples(self) -> dict[str, int]:
        return {connector: sum(counts.values()) for connector, counts in self.hooks.items()}

    def as_json(self) -> dict:
        return {"samples": self.samples, "loop": self.loop, "threads": dict(self.threads),
                "hooks": {connector: dict(counts) for connector, counts in self.hooks.items()}}


def _frame(text: str) -> tuple[str, str]:
    """``(function, path)`` of a Python frame; ``(text, "")`` for a process or thread frame."""
    m = _FRAME.match(text)
    return (m["function"], m["path"]) if m else (text, "")


def summarize(lines) -> SpySummary:
    """The summary of a raw py-spy record's ``lines``; lines that are not ``stack count`` are skipped."""
    out = SpySummary()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        out.samples += n
        thread = next((f for f in frames if f.startswith("thread (")), "")
        out.threads[thread.partition("): ")[2] or "?"] += n
        parsed = [_frame(f) for f in frames]
        if not any(path.endswith(LOOP_FILE) and f"{fn} (".startswith(LOOP) for fn, path in parsed):
            continue
        out.loop += n
        for connector, module in CONNECTORS.items():
            hook = next((fn for fn, path in parsed if path.endswith(module)), None)
            if hook is not None:
                out.hooks.setdefault(connector, Counter())[hook] += n
                break
    return out


def report(name: str, summary: SpySummary) -> list[str]:
    """A few lines: the engine loop's samples, each connector's share, its costliest hooks."""
    lines = [f"{name}: {summary.samples} samples; engine loop {summary.loop}"]
    totals = summary.hook_samples()
    for connector, counts in summary.hooks.items():
        total = totals[connector]
        lines.append(f"  {connector}'s hooks: {total} ({100 * total / max(1, summary.loop):.1f} % of the loop)")
        lines += [f"    {hook:<32} {n:6d}" for hook, n in counts.most_common(8)]
    busy = [f"{name} {n}" for name, n in summary.threads.most_common(6)]
    lines.append("  threads: " + ", ".join(busy))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.engine_spy", description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="+", help="py-spy raw records (-f raw)")
    p.add_argument("--json", metavar="FILE", help="also write the summaries to FILE")
    args = p.parse_args(argv)
    summaries = {}
    for path in args.records:
        with open(path, errors="replace") as f:
            summaries[path] = summarize(f)
        print("\n".join(report(path, summaries[path])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({path: s.as_json() for path, s in summaries.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
