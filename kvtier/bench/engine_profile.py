"""Profiles of chosen rounds of ``kvtier-bench engine --profile DIR``, and what they say.

The engine child builds its engine with vLLM's torch profiler on (:func:`profiler_kwargs`: CPU
ops, Python functions, CUDA kernels), wraps each round tagged ``profile`` in ``start_profile`` /
``stop_profile`` and moves what the engine wrote meanwhile (a trace per worker rank, vLLM's
tables) into ``DIR/<engine>/<tag>/`` (:func:`collect`). kvtier names its own hooks in those traces
(``kvtier.*`` annotations, :mod:`kvtier.profiled`).

:func:`summarize` reads one round's traces: per rank its span, the time in each kvtier hook, and
the costliest CPU ops, Python functions (their own time, without their callees', on the engine
loop's thread; the others mostly wait) and GPU kernels (ms, summed over calls). :func:`grew`
lists what took more in one round than in another: a first reload against a later one, kvtier's
local hit against no connector's, a prefill batch while saving against one without.
"""

from __future__ import annotations

import dataclasses
import gzip
import inspect
import json
import os
import shutil
from collections import defaultdict
from typing import Callable

# trace event categories: what runs on the CPU, what on the GPU
CPU_KINDS = ("user_annotation", "cpu_op", "python_function", "cuda_runtime", "cuda_driver")
GPU_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
TOP = 12
_SKEW_US = 2.0  # a child may end this much after its parent in a trace (clocks of two recorders)


def profiler_kwargs(directory: str) -> dict:
    """``vllm.LLM`` keyword arguments that turn its torch profiler on, traces into ``directory``
    (an absolute path). A vLLM without ``profiler_config`` reads ``VLLM_TORCH_PROFILER_DIR``."""
    from vllm import LLM

    if "profiler_config" not in inspect.signature(LLM.__init__).parameters:
        os.environ["VLLM_TORCH_PROFILER_DIR"] = directory
        os.environ["VLLM_TORCH_PROFILER_WITH_STACK"] = "1"
        return {}
    from vllm.config import ProfilerConfig

    wanted = {"profiler": "torch", "torch_profiler_dir": directory, "torch_profiler_with_stack": True,
              "torch_profiler_use_gzip": True}
    known = {f.name for f in dataclasses.fields(ProfilerConfig)}  # the fields this release has
    return {"profiler_config": {k: v for k, v in wanted.items() if k in known}}


def collect(directory: str, tag: str) -> list[str]:
    """Move what the profiler wrote into ``directory`` since the last call into ``directory/tag``;
    the trace files moved (one per worker rank, and the front end's where it writes one)."""
    target = os.path.join(directory, tag)
    os.makedirs(target, exist_ok=True)
    moved = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            shutil.move(path, os.path.join(target, name))
            if ".trace.json" in name:
                moved.append(os.path.join(target, name))
    return moved


def _events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _top(totals: dict[str, list[float]], n: int = TOP) -> list[list]:
    """[[name, ms, calls]] of the ``n`` largest totals."""
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [[name, round(ms, 2), int(calls)] for name, (ms, calls) in ranked]


def summarize_trace(path: str, since: Callable[[list[dict]], float] | None = None) -> dict:
    """One rank's trace: ``span_ms`` (first event to last end), ``gpu_busy_ms`` (kernel and copy
    time summed), ``kvtier`` {hook: [ms, calls]}, and the costliest ``cpu`` / ``python`` /
    ``gpu`` entries ([[name, ms, calls]], totals over the round). ``since``: given the trace's
    complete events, the time (us, the trace's clock) from which events count; those starting
    before it are left out (a P/D decode engine's round from its load's end on, after a wait of a
    second for the KV)."""
    events = _events(path)
    if events and since is not None:
        start = since(events)
        events = [e for e in events if e["ts"] >= start]
    if not events:
        return {"trace": os.path.basename(path), "span_ms": 0.0}
    begin = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    busiest: dict = defaultdict(float)  # thread -> its CPU ops' time: the engine loop's thread leads
    for e in events:
        if e.get("cat") == "cpu_op":
            busiest[(e.get("pid"), e.get("tid"))] += e["dur"]
    loop = max(busiest, key=busiest.get) if busiest else None
    own = _self_times([e for e in events if (e.get("pid"), e.get("tid")) == loop])
    sums: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for e in events:
        cat = e.get("cat", "")
        if cat == "python_function" and id(e) not in own:
            continue  # other threads' Python frames: mostly waits (chunk server, save thread, lookups)
        kind = ("kvtier" if cat == "user_annotation" and e["name"].startswith("kvtier.") else
                "python" if cat == "python_function" else
                "gpu" if cat in GPU_KINDS else "cpu" if cat in CPU_KINDS else None)
        if kind is not None:
            total = sums[kind][e["name"].split("site-packages/")[-1][:120]]
            total[0] += (own[id(e)] if kind == "python" else e["dur"]) / 1e3
            total[1] += 1
    return {"trace": os.path.basename(path), "span_ms": round((end - begin) / 1e3, 2),
            "gpu_busy_ms": round(sum(ms for ms, _ in sums["gpu"].values()), 2),
            "kvtier": {name: [round(ms, 2), int(calls)] for name, (ms, calls) in sums["kvtier"].items()},
            **{kind: _top(sums[kind]) for kind in ("cpu", "python", "gpu")},
            "_all": {f"{kind}:{name}": ms for kind in ("cpu", "python", "gpu") for name, (ms, _) in sums[kind].items()}}


def _self_times(thread: list[dict]) -> dict[int, float]:
    """id(event) -> its own time, us (its duration less its direct children's): one thread's
    events nest, and a Python frame's own time is where that thread spent it."""
    own: dict[int, float] = {}
    stack: list[dict] = []
    for e in sorted(thread, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1]["ts"] + stack[-1]["dur"] + _SKEW_US < e["ts"] + e["dur"]:
            stack.pop()
        if stack:
            own[id(stack[-1])] -= e["dur"]
        own[id(e)] = e["dur"]
        stack.append(e)
    return {k: max(v, 0.0) for k, v in own.items()}


def summarize(paths: list[str], since: Callable[[list[dict]], float] | None = None) -> list[dict]:
    """:func:`summarize_trace` of each worker rank's trace (vLLM names them after the rank)."""
    return [summarize_trace(p, since) for p in sorted(paths)]


def grew(slow: dict, fast: dict, n: int = 12, min_ms: float = 1.0) -> list[list]:
    """[[entry, ms in ``slow``, ms in ``fast``]] of the ``n`` entries (``cpu:``, ``python:``,
    ``gpu:`` names) whose time grew most from ``fast`` to ``slow`` (two ranks' summaries), by at
    least ``min_ms``."""
    a, b = slow.get("_all", {}), fast.get("_all", {})
    deltas = sorted(((a[k] - b.get(k, 0.0), k) for k in a), reverse=True)
    return [[k, round(a[k], 2), round(b.get(k, 0.0), 2)] for d, k in deltas[:n] if d >= min_ms]


def public(summary: list[dict]) -> list[dict]:
    """A round's summaries without the full per-entry totals (for the JSON)."""
    return [{k: v for k, v in s.items() if k != "_all"} for s in summary]


# (what is compared, (engine, tag) of the slower round, (engine, tag) of the faster one)
COMPARISONS = (
    ("kvtier's first reload against a later one", ("kvtier", "reload-first"), ("kvtier", "reload-later")),
    ("OffloadingConnector's first reload against a later one", ("offload", "reload-first"), ("offload", "reload-later")),
    ("kvtier's reload against OffloadingConnector's", ("kvtier", "reload-later"), ("offload", "reload-later")),
    ("kvtier's local hit against no connector's", ("kvtier", "local"), ("none", "local")),
    ("a chat turn beyond HBM with kvtier against OffloadingConnector", ("kvtier", "chat"), ("offload", "chat")),
    ("a prefill batch with kvtier saving against no connector", ("kvtier", "prefill"), ("none", "prefill")),
    ("a prefill batch with OffloadingConnector saving against no connector", ("offload", "prefill"), ("none", "prefill")),
)


def comparisons(profiles: dict[str, dict[str, list[dict]]], compared: tuple = COMPARISONS) -> list[dict]:
    """Each of ``compared`` (as :data:`COMPARISONS`) both of whose rounds were profiled, rank by rank:
    ``{"what", "ranks": [{"span_ms": [slow, fast], "gpu_busy_ms": [...], "kvtier": hooks of the
    slow round, "grew": grew(slow, fast)}]}``. ``profiles``: engine -> tag -> summaries."""
    out = []
    for what, (e1, t1), (e2, t2) in compared:
        slow, fast = profiles.get(e1, {}).get(t1), profiles.get(e2, {}).get(t2)
        if not slow or not fast:
            continue
        out.append({"what": what, "ranks": [
            {"span_ms": [s["span_ms"], f["span_ms"]], "gpu_busy_ms": [s.get("gpu_busy_ms"), f.get("gpu_busy_ms")],
             "kvtier": s.get("kvtier", {}), "grew": grew(s, f)} for s, f in zip(slow, fast)]})
    return out


def report_lines(compared: list[dict]) -> list[str]:
    """The report's lines for :func:`comparisons`."""
    lines = []
    for c in compared:
        lines.append(f"profile, {c['what']} (ms, slower round / faster round, per worker rank):")
        for rank, r in enumerate(c["ranks"]):
            hooks = ", ".join(f"{k} {ms:.1f} ({n})" for k, (ms, n) in sorted(r["kvtier"].items(), key=lambda kv: -kv[1][0]))
            lines.append(f"  rank {rank}: span {r['span_ms'][0]:.1f} / {r['span_ms'][1]:.1f}, GPU busy "
                         f"{r['gpu_busy_ms'][0]:.1f} / {r['gpu_busy_ms'][1]:.1f}; kvtier hooks: {hooks or 'none'}")
            lines += [f"    grew {name}: {a:.1f} / {b:.1f}" for name, a, b in r["grew"]]
    return lines
