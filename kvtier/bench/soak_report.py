"""``kvtier-bench soak``'s verdict, table, trend lines, JSON and plot (see :mod:`kvtier.bench.soak`).

Baselines are the first sample at or after the warm-up; "idle" is the sample taken once the
load stopped and both servers finished everything. RSS growth per request is (idle RSS - baseline
RSS) / requests started after the warm-up, bytes.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.bench.common import NO_MATPLOTLIB, make_parent, pyplot, save_figure

MiB, KiB = 1 << 20, 1 << 10
FD_THREAD_TOLERANCE = 0.05  # fds and threads within 5% of their post-warm-up level


@dataclass
class Criterion:
    """One pass criterion of the verdict: met or not, and the numbers that decided it."""

    name: str
    ok: bool
    detail: str


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _baseline(samples, warmup_s: float):
    later = [s for s in samples if s.t_s >= warmup_s]
    return later[0] if later else samples[-1]


def _delta(first, last, key: str) -> float | None:
    a, b = first.counters.get(key), last.counters.get(key)
    return None if a is None or b is None else b - a


def summarize(name: str, load, samples, idle, warmup_s: float) -> dict:
    turns = load.turns
    ttft = [t.ttft_ms for t in turns if t.ttft_ms is not None and not t.aborted]
    base = _baseline(samples, warmup_s)
    after = sum(1 for t in turns if t.start_s >= base.t_s)
    first = samples[0]
    out = {
        "requests": len(turns), "completed": len(load.completed()), "aborted": sum(t.aborted for t in turns),
        "errors": len(load.errors()), "error_examples": [t.error for t in load.errors()][:5],
        "wall_s": load.wall_s, "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
        "baseline": asdict(base), "idle": asdict(idle), "requests_after_warmup": after,
        "rss_growth_per_request": (idle.rss_bytes - base.rss_bytes) / after if after else None,
        "max_disk_bytes": max((s.disk_bytes or 0) for s in samples) if samples[0].disk_bytes is not None else None,
        "counters": {key: _delta(first, idle, key) for key in idle.counters},
    }
    return out


def evaluate(settings: dict, loads: dict, watch, idle: dict, stopped: dict, log_errors: list[str]) -> dict:
    warm = settings["warmup_s"]
    servers = {name: summarize(name, loads[name], watch.samples[name], idle[name], warm) for name in loads}
    k, r = servers["kvtier"], servers["plain"]
    answers = {name: {(t.session, t.turn): t.text for t in loads[name].completed()} for name in loads}
    common = sorted(set(answers["kvtier"]) & set(answers["plain"]))
    mismatches = [key for key in common if answers["kvtier"][key] != answers["plain"][key]]

    def within(key: str) -> tuple[bool, str]:
        base, end = k["baseline"][key], k["idle"][key]
        limit = max(1, round(FD_THREAD_TOLERANCE * base))
        return abs(end - base) <= limit, f"{base} after warm-up, {end} idle (limit ±{limit}); R: " \
                                         f"{r['baseline'][key]} -> {r['idle'][key]}"

    fds_ok, fds_detail = within("fds")
    threads_ok, threads_detail = within("threads")
    tol = settings["rss_tolerance_kib"] * KiB
    kg, rg = k["rss_growth_per_request"], r["rss_growth_per_request"]
    rss_ok = kg is not None and rg is not None and kg <= max(rg, 0) + tol
    criteria = [
        Criterion("0 errors", k["errors"] == 0 and r["errors"] == 0 and not log_errors,
                  f"K {k['errors']}, R {r['errors']}, K log {len(log_errors)} error lines"),
        Criterion("0 mismatches", not mismatches and len(common) > 0,
                  f"{len(mismatches)} of {len(common)} answers compared differ"),
        Criterion("fds within 5%", fds_ok, fds_detail),
        Criterion("threads within 5%", threads_ok, threads_detail),
        Criterion("KV usage 0 when idle", k["idle"]["kv_usage"] == 0 and r["idle"]["kv_usage"] == 0,
                  f"K {k['idle']['kv_usage']:.3f}, R {r['idle']['kv_usage']:.3f}"),
        Criterion("disk within budget", (k["max_disk_bytes"] or 0) <= settings["disk_bytes"],
                  f"max {(k['max_disk_bytes'] or 0) / MiB:.1f} MiB of {settings['disk_bytes'] / MiB:.0f} MiB"),
        Criterion("RSS growth/request <= R's", rss_ok,
                  f"K {_kib(kg)}, R {_kib(rg)} KiB/request (tolerance {settings['rss_tolerance_kib']} KiB)"),
        Criterion("clean stop", stopped["left"] == 0 and not stopped["bad_chunks"] and stopped["chunk_files"] > 0,
                  f"{stopped['left']} processes left, {len(stopped['bad_chunks'])} bad of {stopped['chunk_files']} "
                  f"chunk files, stopped in {stopped['stop_s']:.1f} s"),
    ]
    return {"benchmark": "soak", "settings": settings, "servers": servers, "compared": len(common),
            "mismatches": [list(m) for m in mismatches][:20], "log_errors": log_errors[:20], "stopped": stopped,
            "criteria": criteria, "samples": watch.as_json(), "watch_errors": watch.errors[:20],
            "turns": {name: [asdict(t) | {"text": None} for t in loads[name].turns] for name in loads}}


def _kib(value) -> str:
    return "n/a" if value is None else f"{value / KiB:.1f}"


def _n(value, scale: float = 1.0, fmt: str = "{:,.0f}") -> str:
    return "n/a" if value is None else fmt.format(value / scale)


def trend_line(now: dict) -> str:
    """One progress line per sample: each server's tree RSS, fds (+ client connections), threads,
    KV usage (and K's disk)."""
    parts = []
    for name, s in now.items():
        disk = "" if s.disk_bytes is None else f" disk {s.disk_bytes / MiB:5.1f} MiB"
        parts.append(f"{name}: rss {s.rss_bytes / MiB:6.0f} MiB fds {s.fds:4d}+{s.client_fds:<2d} thr {s.threads:4d} "
                     f"kv {100 * s.kv_usage:3.0f}% run {s.running:2.0f} ok {_n(s.counters.get('requests_ok'))}{disk}")
    return "t=%5.0fs " % next(iter(now.values())).t_s + " | ".join(parts)


def format_report(result: dict) -> str:
    k, r = result["servers"]["kvtier"], result["servers"]["plain"]
    st = result["settings"]
    rows = [
        ("requests (completed / aborted)", f"{k['requests']} ({k['completed']} / {k['aborted']})",
         f"{r['requests']} ({r['completed']} / {r['aborted']})"),
        ("errors", str(k["errors"]), str(r["errors"])),
        ("wall, s (requests/s)", f"{k['wall_s']:.0f} ({k['requests'] / k['wall_s']:.2f})",
         f"{r['wall_s']:.0f} ({r['requests'] / r['wall_s']:.2f})"),
        ("TTFT p50 / p99, ms", f"{_n(k['ttft_p50_ms'])} / {_n(k['ttft_p99_ms'])}",
         f"{_n(r['ttft_p50_ms'])} / {_n(r['ttft_p99_ms'])}"),
        ("prompt tokens computed", _n(k["counters"].get("tokens_computed")), _n(r["counters"].get("tokens_computed"))),
        ("prompt tokens, engine prefix hit", _n(k["counters"].get("tokens_local_hit")),
         _n(r["counters"].get("tokens_local_hit"))),
        ("prompt tokens loaded by kvtier", _n(k["counters"].get("tokens_external")), "-"),
        ("kvtier hit tokens cpu / disk", f"{_n(k['counters'].get('hit_tokens_cpu'))} / "
                                         f"{_n(k['counters'].get('hit_tokens_disk'))}", "-"),
        ("kvtier loaded / saved, MiB", f"{_n(k['counters'].get('loaded_bytes'), MiB, '{:,.1f}')} / "
                                       f"{_n(k['counters'].get('saved_bytes'), MiB, '{:,.1f}')}", "-"),
        ("kvtier failed loads / dropped saves", f"{_n(k['counters'].get('failed_loads'))} / "
                                                f"{_n(k['counters'].get('dropped_saves'))}", "-"),
        ("RSS after warm-up -> idle, MiB", f"{k['baseline']['rss_bytes'] / MiB:.0f} -> {k['idle']['rss_bytes'] / MiB:.0f}",
         f"{r['baseline']['rss_bytes'] / MiB:.0f} -> {r['idle']['rss_bytes'] / MiB:.0f}"),
        ("RSS growth per request, KiB", _kib(k["rss_growth_per_request"]), _kib(r["rss_growth_per_request"])),
        ("fds after warm-up -> idle (no client sockets)", f"{k['baseline']['fds']} -> {k['idle']['fds']}",
         f"{r['baseline']['fds']} -> {r['idle']['fds']}"),
        ("threads after warm-up -> idle", f"{k['baseline']['threads']} -> {k['idle']['threads']}",
         f"{r['baseline']['threads']} -> {r['idle']['threads']}"),
        ("KV usage idle", f"{k['idle']['kv_usage']:.3f}", f"{r['idle']['kv_usage']:.3f}"),
        ("disk tier max, MiB", _n(k["max_disk_bytes"], MiB, "{:,.1f}"), "-"),
    ]
    width = max(len(row[0]) for row in rows)
    lines = [f"kvtier-bench soak: {st['sessions']} sessions x {st['duration_s']} s per server, warm-up {st['warmup_s']} s; "
             f"K = kvtier (CPU tier {st['cpu_bytes'] / MiB:.0f} MiB, disk {st['disk_bytes'] / MiB:.0f} MiB), "
             f"R = no connector; {result['compared']} answers compared", "",
             f"{'':{width}}  {'K (kvtier)':>26}  {'R (no connector)':>26}"]
    lines += [f"{name:{width}}  {a:>26}  {b:>26}" for name, a, b in rows]
    lines += ["", "trend (K): " + _trend(result["samples"]["kvtier"], st["warmup_s"]),
              "trend (R): " + _trend(result["samples"]["plain"], st["warmup_s"]), "", "pass criteria:"]
    lines += [f"  [{'ok' if c.ok else 'MISSED'}] {c.name}: {c.detail}" for c in result["criteria"]]
    verdict = "PASS" if all(c.ok for c in result["criteria"]) else "FAIL"
    return "\n".join(lines + ["", f"soak {verdict}"])


def _trend(samples: list[dict], warmup_s: float) -> str:
    """RSS, fds and threads from the first post-warm-up sample to the last, and RSS's slope."""
    later = [s for s in samples if s["t_s"] >= warmup_s] or samples[-1:]
    a, b = later[0], later[-1]
    span_min = max(1e-9, (b["t_s"] - a["t_s"]) / 60)
    return (f"RSS {a['rss_bytes'] / MiB:.0f} -> {b['rss_bytes'] / MiB:.0f} MiB "
            f"({(b['rss_bytes'] - a['rss_bytes']) / MiB / span_min:+.1f} MiB/min), fds {a['fds']} -> {b['fds']}, "
            f"threads {a['threads']} -> {b['threads']}, KV usage max "
            f"{100 * max(s['kv_usage'] for s in later):.0f}%, {len(samples)} samples")


def write_json(result: dict, path: str) -> None:
    data = dict(result, criteria=[asdict(c) for c in result["criteria"]],
                ok=all(c.ok for c in result["criteria"]))
    make_parent(path)
    Path(path).write_text(json.dumps(data, indent=1))


def write_plot(result: dict, path: str) -> str | None:
    """Four panels over time: tree RSS, fds and threads, KV usage, K's disk tier. Returns None, or
    why the plot was skipped."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for name, samples in result["samples"].items():
        label = "K (kvtier)" if name == "kvtier" else "R (no connector)"
        t = [s["t_s"] for s in samples]
        axes[0][0].plot(t, [s["rss_bytes"] / MiB for s in samples], label=label)
        axes[0][1].plot(t, [s["fds"] for s in samples], label=f"{label} fds")
        axes[0][1].plot(t, [s["threads"] for s in samples], linestyle="--", label=f"{label} threads")
        axes[1][0].plot(t, [100 * s["kv_usage"] for s in samples], label=label)
        if name == "kvtier":
            axes[1][1].plot(t, [(s["disk_bytes"] or 0) / MiB for s in samples], label="disk tier")
    st = result["settings"]
    axes[1][1].axhline(st["disk_bytes"] / MiB, color="red", linestyle=":", label="disk_bytes")
    for ax, title in zip(axes.flat, ("process tree RSS, MiB", "open fds / threads", "engine KV blocks in use, %",
                                      "kvtier disk tier, MiB")):
        ax.set_title(title, fontsize=9)
        ax.axvline(st["warmup_s"], color="grey", linestyle=":", linewidth=0.8)
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("s")
    verdict = "PASS" if all(c.ok for c in result["criteria"]) else "FAIL"
    fig.suptitle(f"kvtier-bench soak: {st['sessions']} sessions x {st['duration_s']} s, {verdict}", fontsize=10)
    save_figure(fig, path, dpi=110)
    return None
