"""The P/D benchmark's outputs: the plain-text tables, the JSON record and the bar chart.

Times are milliseconds. A row's figure is the median (and the best, i.e. fastest) of its samples;
ratios (``x``) are ratios of medians. See :mod:`kvtier.bench.pd` for what each row measures; it
builds the :class:`PdResult` this module formats.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
from dataclasses import asdict, dataclass

from kvtier.bench.common import NO_MATPLOTLIB, cpu_model, make_parent, pyplot, save_figure
from kvtier.bench.pd_request import ROWS, Sample
from kvtier.bench.pd_setup import Geometry, Sizes

LABELS = {"recompute": "recompute", "local_hit": "local hit", "pull": "P/D pull", "push": "P/D push"}
PD_ROWS = ("pull", "push")
# A request is disturbed when other processes used more than DISTURBED_SHARE of one core during it,
# and at least DISTURBED_MIN_S (below that: kernel threads and jiffy rounding, s).
DISTURBED_SHARE, DISTURBED_MIN_S = 0.1, 0.5


@dataclass
class PdResult:
    """Everything one ``kvtier-bench pd`` run measured, and how it was set up."""

    model: str  # --model's path, or how the bench built one
    geometry: Geometry
    sizes: Sizes
    cores: dict  # server name -> the core its OpenMP threads are bound to
    chunk_tokens: int
    pd_timeout_ms: int  # kvtier's pd_timeout_ms on P and D, ms
    max_tokens: int
    repeats: int
    prompt_lens: list
    samples: list  # of Sample
    startup_s: float  # until every server and proxy answered /health, s
    load_avg: tuple  # 1-minute load average at the start and the end of the run
    elapsed_s: float

    def row(self, length: int, row: str) -> list[Sample]:
        return [s for s in self.samples if s.prompt_tokens == length and s.row == row]

    @property
    def mismatches(self) -> list[Sample]:
        """Samples whose text differs from R's cold answer for the same prompt."""
        return [s for s in self.samples if s.identical is False]

    @property
    def not_transferred(self) -> list[Sample]:
        """P/D samples where D loaded less than the prompt, or the push proxy did not push."""
        return [s for s in self.samples if s.row in PD_ROWS and (not s.transferred or s.proxy_mode != s.row)]

    @property
    def disturbed(self) -> list[Sample]:
        """Samples during which other processes used more than DISTURBED_SHARE of one core."""
        return [s for s in self.samples if s.others_cpu_s > max(DISTURBED_MIN_S, DISTURBED_SHARE * s.total_ms / 1e3)]

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.not_transferred


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summary(result: PdResult, length: int) -> dict:
    """One prompt length: per row its TTFT samples, median, best, checks and median legs; the ratios."""
    rows = {}
    for name in ROWS:
        samples = result.row(length, name)
        ttft = [s.ttft_ms for s in samples]
        checked = [s.identical for s in samples if s.identical is not None]
        legs = {key: _median([s.legs.get(key) for s in samples]) for key in (samples[0].legs if samples else {})}
        rows[name] = {
            "ttft_ms": ttft, "median_ms": _median(ttft), "best_ms": min(ttft) if ttft else None,
            "samples": len(samples), "identical": all(checked) if checked else None,
            "others_cpu_s": [round(s.others_cpu_s, 2) for s in samples],
            "tokens_moved": [s.moved for s in samples] if name in PD_ROWS else None,
            "transferred": all(s.transferred and s.proxy_mode == name for s in samples) if name in PD_ROWS else None,
            "legs_median": legs,
        }
    med = {name: rows[name]["median_ms"] for name in ROWS}
    ratios = {"pull_x_local_hit": _ratio(med["pull"], med["local_hit"]),
              "push_x_local_hit": _ratio(med["push"], med["local_hit"]),
              "recompute_x_pull": _ratio(med["recompute"], med["pull"]),
              "recompute_x_push": _ratio(med["recompute"], med["push"])}
    return {"prompt_tokens": length, "rows": rows, "ratios": ratios}


def _fmt(value: float | None, fmt: str = "{:,.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths))

    rule = "-" * len(line(head))
    return [rule, line(head), rule, *map(line, rows), rule]


def format_table(result: PdResult) -> str:
    """Header lines, the TTFT table, the P/D breakdown table, the checks and the column notes."""
    g, z = result.geometry, result.sizes
    top = [
        f"kvtier-bench pd on {cpu_model()} ({os.cpu_count()} cores); load average {result.load_avg[0]:.2f} at start, "
        f"{result.load_avg[1]:.2f} at end; bench wall time {result.elapsed_s:.0f} s "
        f"(servers up in {result.startup_s:.0f} s)",
        f"model: {result.model}: {g.params / 1e6:.1f}M parameters, {g.layers} layers x {g.kv_heads} KV heads x head dim "
        f"{g.head_dim}, float32, {g.kv_bytes_per_token / 1024:.0f} KiB of KV per token",
        f"servers (each pinned to its core): R (no connector, core {result.cores['R']}), P and D (kvtier kv_both, cores "
        f"{result.cores['P']} and {result.cores['D']}), kvtier-proxy --mode pull and --mode push; "
        f"KV cache {z.kv_cache_bytes / 2**20:.0f} MiB, CPU tier {z.cpu_bytes / 2**20:.0f} MiB, "
        f"chunk {result.chunk_tokens} tokens, pd_timeout_ms {result.pd_timeout_ms}",
        f"TTFT in ms at the client (send -> first streamed token of a greedy {result.max_tokens}-token completion): "
        f"median / best of {result.repeats} fresh prompts (recompute: {2 * result.repeats})",
    ]
    main, legs = [], []
    for length in result.prompt_lens:
        s = summary(result, length)
        rows, ratios = s["rows"], s["ratios"]
        cells = [f"{_fmt(rows[n]['median_ms'])} / {_fmt(rows[n]['best_ms'])}" for n in ROWS]
        moved = " / ".join(_fmt(min(rows[n]["tokens_moved"]), "{:d}") for n in PD_ROWS)
        flagged = [LABELS[n] for n in PD_ROWS if not rows[n]["transferred"]]
        if flagged:
            moved += " NOT TRANSFERRED: " + ", ".join(flagged)
        wrong = [f"{LABELS[n]} {sum(x.identical is False for x in result.row(length, n))}/{rows[n]['samples']}"
                 for n in ROWS if rows[n]["identical"] is False]
        main.append([str(length), *cells, *(_fmt(ratios[k], "{:.1f}x") for k in (
            "pull_x_local_hit", "push_x_local_hit", "recompute_x_pull", "recompute_x_push")),
            moved, "yes" if not wrong else "NO: " + ", ".join(wrong)])
        for n in ROWS:
            m = rows[n]["legs_median"]
            if n in PD_ROWS:
                legs.append([str(length), LABELS[n], _fmt(rows[n]["median_ms"]), _fmt(m["p_prefill_ms"]),
                             _fmt(m["p_leg_ms"]), _fmt(m["d_kv_wait_ms"]), _fmt(m["d_compute_ms"]),
                             _fmt(m["d_leg_ttfb_ms"]), _fmt(m["d_computed_tokens"])])
            else:
                legs.append([str(length), LABELS[n], _fmt(rows[n]["median_ms"]), _fmt(m["r_prefill_ms"]),
                             "", "", "", "", _fmt(m["r_computed_tokens"])])
    head = ["prompt", "recompute ms", "local hit ms", "pull ms", "push ms", "pull x local hit", "push x local hit",
            "recompute x pull", "recompute x push", "tokens moved (pull / push)", "outputs identical"]
    leg_head = ["prompt", "row", "TTFT", "prefill (R or P)", "P leg", "D waits for KV", "D compute",
                "D leg 1st byte", "tokens computed (R or D)"]
    bottom = [
        "ratios (x) are of medians: pull x local hit = pull / local hit (what P/D costs over a local prefix hit); "
        "recompute x pull = recompute / pull (P/D's speed-up over recomputing).",
        "tokens moved: the fewest prompt tokens D loaded from P in one request "
        "(vllm:prompt_tokens_by_source_total{source=\"external_kv_transfer\"}); a P/D row needs prompt - 1 or more.",
        "",
        "where the time goes (median ms):",
        *_table(leg_head, legs),
        "prefill: the engine's own prefill time of the prompt (vllm:request_prefill_time_seconds) on R, or on P for the "
        "P/D rows; P leg: the proxy's request to P until its answer (pull: before D's leg starts; push: at the same time);",
        "D waits for KV: D's queue time (vLLM schedules a request once its remote KV is in); D compute: D's prefill of "
        "what it did not load, to the first token; D leg 1st byte: the proxy's request to D until D's first byte.",
    ]
    checks = []
    for s in result.mismatches:
        checks.append(f"MISMATCH: {LABELS[s.row]}, {s.prompt_tokens} tokens, repeat {s.repeat + 1}: tokens "
                      f"{s.token_ids} ({s.text!r}) differ from recompute's")
    for s in result.not_transferred:
        checks.append(f"NOT TRANSFERRED: {LABELS[s.row]}, {s.prompt_tokens} tokens, repeat {s.repeat + 1}: D loaded "
                      f"{s.moved} tokens; the proxy's flow was {s.proxy_mode}")
    checks = checks or ["checks: every answer equals recompute's; every P/D request loaded the prompt from P"]
    others = sum(s.others_cpu_s for s in result.samples)
    wall = sum(s.total_ms for s in result.samples) / 1e3
    line = f"other processes used {others:.1f} CPU-s during the {wall:.0f} s of timed requests"
    if result.disturbed:
        line += (f"; WARNING: a busy machine: {len(result.disturbed)} of {len(result.samples)} requests ran while "
                 f"others used over {DISTURBED_SHARE:.0%} of a core (" + ", ".join(
                     f"{LABELS[s.row]} {s.prompt_tokens}/{s.repeat + 1}: {s.others_cpu_s:.1f} s"
                     for s in result.disturbed) + "); compare only runs on a quiet machine")
    checks.append(line)
    return "\n".join([*top, *_table(head, main), *checks, *bottom])


def to_json(result: PdResult) -> dict:
    g, z = result.geometry, result.sizes
    return {
        "benchmark": "pd",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpu": cpu_model(), "cores": os.cpu_count(),
                 "load_avg_1min": {"start": result.load_avg[0], "end": result.load_avg[1]}},
        "model": {"source": result.model, "params": g.params, "layers": g.layers, "kv_heads": g.kv_heads,
                  "head_dim": g.head_dim, "hidden": g.hidden, "vocab": g.vocab, "dtype": "float32",
                  "kv_bytes_per_token": g.kv_bytes_per_token},
        "servers": {"kv_cache_bytes": z.kv_cache_bytes, "max_model_len": z.max_model_len, "cpu_tier_bytes": z.cpu_bytes,
                    "chunk_tokens": result.chunk_tokens, "pd_timeout_ms": result.pd_timeout_ms, "cores": result.cores,
                    "startup_s": result.startup_s},
        "max_tokens": result.max_tokens,
        "repeats": result.repeats,
        "units": {"ms": "milliseconds, client-side for ttft_ms", "x": "ratio of medians",
                  "tokens_moved": "prompt tokens D loaded from P (external_kv_transfer)"},
        "results": [summary(result, length) for length in result.prompt_lens],
        "samples": [asdict(s) for s in result.samples],
        "others_cpu_s": sum(s.others_cpu_s for s in result.samples),
        "disturbed_samples": len(result.disturbed),
        "identical": not result.mismatches,
        "transferred": not result.not_transferred,
        "ok": result.ok,
        "elapsed_s": result.elapsed_s,
    }


def write_json(result: PdResult, path: str) -> None:
    make_parent(path)
    with open(path, "w") as f:
        json.dump(to_json(result), f, indent=2)
        f.write("\n")


def write_plot(result: PdResult, path: str) -> str | None:
    """Grouped bars: median TTFT per row for each prompt length (log scale when they span 30x or
    more), the best sample as a tick on each bar. Returns None, or why the plot was skipped."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    summaries = [summary(result, length) for length in result.prompt_lens]
    fig, ax = plt.subplots(figsize=(3.2 + 2.4 * len(summaries), 4.8))
    width = 0.2
    for j, name in enumerate(ROWS):
        xs = [i + (j - 1.5) * width for i in range(len(summaries))]
        med = [s["rows"][name]["median_ms"] or 0.0 for s in summaries]
        best = [s["rows"][name]["best_ms"] or 0.0 for s in summaries]
        bars = ax.bar(xs, med, width, label=LABELS[name])
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in med], fontsize=7)
        ax.scatter(xs, best, marker="_", color="black", s=120, zorder=3, label="best" if j == len(ROWS) - 1 else None)
    values = [s["rows"][n]["median_ms"] for s in summaries for n in ROWS if s["rows"][n]["median_ms"]]
    if values and max(values) / min(values) >= 30:
        ax.set_yscale("log")
    ax.set_xticks(range(len(summaries)), [f"{s['prompt_tokens']} tokens" for s in summaries])
    ax.set_ylabel(f"TTFT, ms (median of {result.repeats}; tick: best)")
    ax.legend(fontsize=8)
    g = result.geometry
    ax.set_title(f"kvtier-bench pd: TTFT, {g.params / 1e6:.0f}M-param Llama, float32\n"
                 f"{cpu_model()}, one core per engine", fontsize=9)
    save_figure(fig, path)
    return None
