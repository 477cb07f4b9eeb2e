"""``kvtier-bench pd-engines --profile DIR``: where a kvtier decode engine's step to its first
token goes after a push, against after a pull HBM to HBM.

The decode engine over NIXL (D) runs with vLLM's torch profiler on (CPU ops, Python functions,
CUDA kernels: :func:`kvtier.bench.engine_profile.profiler_kwargs`). Once the longest prompt's
timed repeats are done, D answers one more pull HBM to HBM and one more push of that length
under the profiler; neither is timed (the profiler slows the host side) and both are checked as
the timed ones are. Each trace is summed up (:func:`~kvtier.bench.engine_profile.summarize_trace`)
from the moment D's scheduler saw the load end (:func:`from_load_seen`: its vLLM then caches the
prompt's blocks and runs the step that computes the first token), rank by rank, with what took
longer after the push than after the pull: ``DIR/summary.txt``, the result's ``d_profile`` and the
table. The traces stay in ``DIR/kvtier-D/pull`` and ``DIR/kvtier-D/push``.
"""

from __future__ import annotations

import os

from kvtier.bench import engine_profile

TAIL_MS = 40.0  # without the marks from_load_seen looks for: the trace's last 40 ms (D's step is 13-17 at 32k)
ENGINE_DIR = "kvtier-D"  # DIR/<this>/<tag>: the profiled D's traces
SEEN = "kvtier.update_connector_output"  # the scheduler hook that hears of a load's end
IDLE_STEP = "execute_context_0(0)_generation_0(0)"  # vLLM's range of a step that computes nothing


def from_load_seen(events: list[dict]) -> float:
    """The start (us) of the last :data:`SEEN` range before the first step that computes tokens
    (vLLM's ``execute_context_<n>(<tokens>)_generation_…`` ranges other than :data:`IDLE_STEP`):
    where D's scheduler saw the load end; the trace's last :data:`TAIL_MS` where either is missing."""
    working = [e["ts"] for e in events if e["name"].startswith("execute_context_") and e["name"] != IDLE_STEP]
    first = min(working, default=None)
    seen = [e["ts"] for e in events if e["name"] == SEEN and first is not None and e["ts"] < first]
    return max(seen) if seen else max(e["ts"] + e["dur"] for e in events) - TAIL_MS * 1e3


def profile_dir(root: str) -> str:
    """Where D's profiler writes, under ``--profile DIR`` (an absolute path, as vLLM wants)."""
    return os.path.join(os.path.abspath(root), ENGINE_DIR)


def profile_d(run, p, d, n: int, endpoints: list[str]) -> dict:
    """One pull HBM to HBM and one push of ``n`` tokens with D under its profiler (``run``: the
    :class:`~kvtier.bench.pd_engines_rows.Run`, P and D up); the ``d_profile`` record:
    ``{"since", "traces": {tag: paths}, "summaries": {tag: per-rank summaries}, "lines"}``."""
    run.progress(f"profiling D: one more pull and push of {n} tokens (not timed)")
    traces = {"pull": run.pull("kvtier pull hbm", p, d, n, profile="pull").get("traces") or [],
              "push": run.push("kvtier push nixl", p, d, n, endpoints, profile="push").get("traces") or []}
    summaries = {tag: engine_profile.summarize(paths, from_load_seen) for tag, paths in traces.items()}
    what = f"D from its load seen to its first token at {n} tokens, after a push against after a pull HBM to HBM"
    compared = engine_profile.comparisons({"D": summaries}, ((what, ("D", "push"), ("D", "pull")),))
    lines = engine_profile.report_lines(compared) or [f"profile of D: no traces ({run.args.profile})"]
    for tag, ranks in summaries.items():
        for rank, s in enumerate(ranks):
            top = ", ".join(f"{name} {ms:.1f}" for name, ms, _ in s.get("gpu", [])[:4])
            lines.append(f"  {tag}, rank {rank}: costliest GPU work from the load seen on: {top or 'none'}")
    os.makedirs(run.args.profile, exist_ok=True)  # also where no trace was written
    path = os.path.join(run.args.profile, "summary.txt")
    with open(path, "w") as f:
        f.writelines(f"{line}\n" for line in lines)
    run.progress(f"wrote {path}")
    return {"since": "load seen", "traces": traces,
            "summaries": {tag: engine_profile.public(s) for tag, s in summaries.items()}, "lines": lines}
