"""What ``kvtier-bench engine`` prints and draws from its result (:func:`kvtier.bench.engine.run`):
the TTFT table with its targets, the KV bytes each reload moved beside what the model's config
says it must, and a bar chart of both.

Bytes per reload come from the connector's own stats for the reload round (the engine child's
``transfers``, reduced as vLLM logs them): kvtier's ``loaded_bytes``; vLLM's offloading connector's
``vllm:kv_offload_load_bytes`` (newer releases) or ``CPU_to_GPU_total_bytes`` (older ones).
"""

from __future__ import annotations

import statistics

from kvtier.bench import engine_busy
from kvtier.bench.common import NO_MATPLOTLIB, pyplot, save_figure
from kvtier.bench.engine_model import KvShape
from kvtier.bench.engine_profile import report_lines

# Keys of a connector's reduced stats that hold the KV bytes it loaded into engine blocks.
LOADED_BYTES_KEYS = ("loaded_bytes", "vllm:kv_offload_load_bytes", "CPU_to_GPU_total_bytes")
MiB = 1 << 20


def _med(values) -> float:
    return statistics.median(values)


def loaded_bytes(transfers: dict | None) -> int | None:
    """KV bytes a connector loaded in one round, from its reduced stats (``{}``: it reported
    nothing, so 0). None where they were not counted or no key of :data:`LOADED_BYTES_KEYS` is
    there; a key with labels (``name:(...)``) counts toward its name."""
    if transfers is None:
        return None
    if not transfers:
        return 0
    for key in LOADED_BYTES_KEYS:
        values = [v for k, v in transfers.items() if k == key or k.startswith(key + ":")]
        if values:
            return int(sum(values))
    return None


def kv_shape_of(result: dict) -> KvShape:
    """The result's :class:`KvShape`; a result written before it was recorded had every layer full."""
    if "kv_shape" in result:
        return KvShape(**result["kv_shape"])
    return KvShape(result["kv_bytes_per_token"], 1)


def reload_bytes(result: dict, engine: str, n: str) -> float | None:
    """Median KV bytes ``engine`` loaded per reload of ``n``-token prompts; None where not counted."""
    counted = [loaded_bytes(t) for t in result.get("reload_transfers", {}).get(engine, {}).get(n, [])]
    counted = [b for b in counted if b is not None]
    return _med(counted) if counted else None


def copy_ms(result: dict, tokens: int) -> float:
    """Milliseconds the raw pinned host-to-device memcpy takes for the KV a reload of ``tokens``
    tokens must move (the window bound: every layer's KV for a model without sliding layers)."""
    return kv_shape_of(result).window_bound_bytes(tokens) / result["h2d_gbps"] / 1e6


def format_table(result: dict) -> str:
    ms = result["ttft_ms"]
    shape = kv_shape_of(result)
    lines = [f"kvtier-bench engine: vLLM {result['vllm']} on {result['device']}"
             + (f", {result['model']}" if result.get("model") else "")
             + ("; CUDA graphs" if result.get("args", {}).get("cuda_graphs") else "; eager")
             + (f"; TTFT ms, median of {result['repeats']}" if result["lengths"] else "")
             + (f"; raw pinned H2D {result['h2d_gbps']:.1f} GB/s" if result.get("h2d_gbps") else "")
             + "; " + shape.describe()]
    head = (f"{'tokens':>6} {'recompute':>9} {'local':>6} {'kvtier cpu':>10} {'kvtier disk':>11} {'vLLM offload':>12} "
            f"{'target':>6}  kvtier/vLLM  kvtier/target")
    lines += [head, "-" * len(head)] if result["lengths"] else []  # --busy-only: no TTFT
    fmt = lambda v, w: f"{v:>{w}.0f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
    for n in map(str, result["lengths"]):
        def cell(engine: str, mode: str) -> float | None:
            values = ms.get(engine, {}).get(n, {}).get(mode)
            return _med(values) if values else None

        local = cell("none", "local") or cell("kvtier", "local")
        kv, off = cell("kvtier", "reload"), cell("offload", "reload")
        target = None if local is None else local + 1.1 * copy_ms(result, int(n))
        lines.append(f"{n:>6} {fmt(cell('none', 'recompute'), 9)} {fmt(local, 6)} {fmt(kv, 10)} "
                     f"{fmt(cell('disk', 'disk'), 11)} {fmt(off, 12)} {fmt(target, 6)}  {ratio(kv, off):>11}  {ratio(kv, target):>13}")
    lines += _bytes_lines(result, shape)
    lines += local_lines(result)
    loads = result.get("kvtier_load_ms") or {}
    if loads and result["lengths"]:
        lines.append("where a kvtier reload's time goes (median ms): " + "; ".join(
            f"{n} tokens: load in the worker {_med(loads[n]):.0f} (raw H2D of its bytes {copy_ms(result, int(n)):.0f})"
            for n in map(str, result["lengths"]) if n in loads))
    for key, what in (("kvtier_stages_ms", "a kvtier reload's stages (median ms over the TTFT reloads"),
                      ("kvtier_first_load_stages_ms", "the first load after start (ms")):
        if result.get(key):
            lines.append(f"{what}, kvtier timeline): " + ", ".join(f"{s} {ms:.1f}" for s, ms in result[key].items()))
    if result["chat_s"]:
        runs = max((len(v) for v in result.get("chat_runs_s", {}).values()), default=1)
        lines.append("multi-turn chat, rounds 2+ (s" + (f"; per-round medians of {runs} runs" if runs > 1 else "")
                     + "): " + ", ".join(f"{k} {sum(v[1:]):.2f}" for k, v in result["chat_s"].items()))
        lines += engine_busy.chat_run_lines(result) + engine_busy.step_lines(result)
    lines += chat_lines(result)
    lines += engine_busy.report_lines(result)
    if result["prefill_tok_s"]:
        base = result["prefill_tok_s"].get("none")
        lines.append("prefill tok/s (median of 3 batches): " + ", ".join(
            f"{k} {_med(v):.0f}" + (f" ({_med(v) / _med(base):.3f} x none)" if base and k != "none" else "")
            for k, v in result["prefill_tok_s"].items()))
    lines.append("engine start (s): " + ", ".join(f"{k} {v:.1f}" for k, v in result["start_s"].items()))
    firsts = [(engine, *first) for engine in ("kvtier", "offload") if (first := first_reload(result, engine))]
    if firsts:
        lines.append("first reload after start (ms, then the later ones' median at that length): " + ", ".join(
            f"{engine} {first:.0f} at {n} tokens (later {later:.0f}, {first / later:.2f} x)"
            for engine, n, first, later in firsts))
    lines += report_lines(result.get("profile_compared", []))
    checked = "16-token checks, every chat reply" if result["chat_s"] else "16-token checks"
    lines.append(f"greedy outputs identical across engines ({checked}): " + ("yes" if result["identical"] else "NO"))
    lines.append("targets: kvtier cpu <= vLLM offload; kvtier cpu <= target = local + 1.1 x (window bound bytes / raw "
                 "pinned H2D); local hit <= none's + 2 ms; chat rounds 2+ <= vLLM's; prefill >= 0.99 x none; "
                 "start <= vLLM's + 5 s" if result["lengths"] else "targets: chat rounds 2+ <= vLLM's; zero-hit "
                 ">= 0.99 x none; start <= vLLM's + 5 s")
    return "\n".join(lines)


def chat_lines(result: dict) -> list[str]:
    """Per engine, the chat's rounds 2+ summed: prompt tokens, those it computed (not found in its
    own prefix cache or loaded) and those the connector loaded; kvtier's load stages in the chat."""
    reuse = result.get("chat_reuse") or {}
    token_bytes = kv_shape_of(result).token_bytes
    parts = []
    for engine, rounds in reuse.items():
        later = rounds[1:]
        if not later or any(r["prompt"] is None for r in later):
            continue
        prompt = sum(r["prompt"] for r in later)
        text = f"{engine} {prompt - sum(r['cached'] for r in later)} of {prompt}"
        if all(r["loaded_bytes"] is not None for r in later):
            text += f", {sum(r['loaded_bytes'] for r in later) // token_bytes} loaded"
        parts.append(text)
    lines = ["multi-turn chat, rounds 2+, prompt tokens computed (of all; loaded by the connector): "
             + ", ".join(parts)] if parts else []
    waits = [r.get("engine_waits") or {} for r in reuse.get("kvtier", [])[1:]]
    if any(waits):
        total = {k: sum(w.get(k, 0) for w in waits) for k in engine_busy.ENGINE_WAITS}
        lines.append(f"kvtier made the engine wait, rounds 2+: {total['engine_waits_save_reads']} steps for a save "
                     f"still reading their blocks, {total['engine_waits_save_backlog']} saves for a full save backlog "
                     f"({total['engine_wait_ms_save_backlog']:.0f} ms)")
    if stages := result.get("kvtier_chat_stages_ms"):
        loads = stages.get("loads")
        lines.append(f"kvtier's loads in the chat ({loads}; median ms, kvtier timeline): " + ", ".join(
            f"{s} {ms:.1f}" for s, ms in stages.items() if s != "loads"))
    return lines


def local_lines(result: dict) -> list[str]:
    """Each engine's local prefix hit beside the connector-less engine's: median, and the spread
    (min-max) of its samples, ms; nothing without the connector-less engine."""
    ms = result["ttft_ms"]
    parts = []
    for n in map(str, result["lengths"]):
        base = ms.get("none", {}).get(n, {}).get("local")
        if not base:
            continue
        cells = []
        for engine in ms:
            values = ms[engine].get(n, {}).get("local")
            if values:
                extra = "" if engine == "none" else f" {_med(values) - _med(base):+.0f}"
                cells.append(f"{engine} {_med(values):.0f} ({min(values):.0f}-{max(values):.0f}){extra}")
        parts.append(f"{n} tokens: " + ", ".join(cells))
    return ["local hit (median ms, (min-max), against none): " + "; ".join(parts)] if parts else []


def first_reload(result: dict, engine: str) -> tuple[str, float, float] | None:
    """(length, the first reload's TTFT, the later ones' median) of ``engine`` at the first length
    measured with at least two reloads, ms: an engine's first reload after start pays what later
    ones do not (a CUDA context, a kernel's first launch)."""
    if result.get("args", {}).get("profile"):
        return None  # the first reload after start was a profiled one
    for n in map(str, result["lengths"]):
        values = result["ttft_ms"].get(engine, {}).get(n, {}).get("reload") or []
        if len(values) >= 2:
            return n, values[0], _med(values[1:])
    return None


def _bytes_lines(result: dict, shape: KvShape) -> list[str]:
    """KV bytes per reload (MiB): the two reference figures, each engine's, and its ratio to the bound."""
    if not result.get("reload_transfers"):
        return []
    window = (f"+ the sliding layers' KV of the last {shape.window} tokens" if shape.sliding_layers
              else "(no sliding layers: the same)")
    lines = [f"KV bytes per reload (MiB, median): full attention = every layer's KV of the prompt; window bound = "
             f"the full-attention layers' KV {window}"]
    head = (f"{'tokens':>6} {'full attn':>9} {'window bound':>12} {'kvtier':>8} {'/bound':>6} "
            f"{'vLLM offload':>12} {'/bound':>6}")
    lines += [head, "-" * len(head)]
    for n in map(str, result["lengths"]):
        bound = shape.window_bound_bytes(int(n))
        cells = []
        for engine, width in (("kvtier", 8), ("offload", 12)):
            moved = reload_bytes(result, engine, n)
            cells.append(f"{moved / MiB:>{width}.0f} {moved / bound:>6.2f}" if moved is not None
                         else f"{'n/a' if engine in result['reload_transfers'] else '-':>{width}} {'-':>6}")
        lines.append(f"{n:>6} {shape.full_attention_bytes(int(n)) / MiB:>9.0f} {bound / MiB:>12.0f} " + " ".join(cells))
    hybrid = result.get("hybrid") or {}
    if shape.sliding_layers and hybrid:
        said = {True: "on", False: "OFF (every layer full)", None: "not reported"}
        lines.append("vLLM's hybrid KV cache manager: " + ", ".join(f"{k} {said[v]}" for k, v in hybrid.items()))
    return lines


def write_plot(result: dict, path: str) -> str | None:
    """TTFT bars per length and mode, KV bytes per reload against the reference figures (where TTFT
    ran), chat rounds 2+ per engine where the chat ran, zero-hit output tok/s where that ran. None
    or why skipped."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    panels = [_ttft_bars, _bytes_bars] if result["lengths"] else []
    panels += [_chat_bars] if result["chat_s"] else []
    panels += [_zero_hit_bars] if result.get("zero_hit_tok_s") else []
    if not panels:
        return "nothing to draw"
    ratios = [2 if p is _ttft_bars else 1 for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(1.5 + 3.5 * sum(ratios), 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": ratios})
    for ax, draw in zip(axes[0], panels):
        draw(ax, result)
    save_figure(fig, path)
    return None


def _chat_bars(ax, result: dict) -> None:
    names = list(result["chat_s"])
    bars = ax.bar(names, [sum(result["chat_s"][k][1:]) for k in names], color="tab:gray")
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_ylabel("seconds, chat rounds 2+")
    ax.set_title("multi-turn chat beyond HBM", fontsize=9)


def _zero_hit_bars(ax, result: dict) -> None:
    tok_s = result["zero_hit_tok_s"]
    bars = ax.bar(list(tok_s), list(tok_s.values()), color="tab:olive")
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title("zero-hit prompts (nothing to load)", fontsize=9)


def _ttft_bars(ax, result: dict) -> None:
    modes = [("none", "recompute", "recompute"), ("none", "local", "local hit"), ("kvtier", "reload", "kvtier cpu"),
             ("disk", "disk", "kvtier disk"), ("offload", "reload", "vLLM offload")]
    lengths = list(map(str, result["lengths"]))
    width = 0.8 / len(modes)
    for i, (engine, mode, label) in enumerate(modes):
        values = [_med(result["ttft_ms"].get(engine, {}).get(n, {}).get(mode) or [0]) for n in lengths]
        bars = ax.bar([g + (i - 2) * width for g in range(len(lengths))], values, width, label=label)
        ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], fontsize=7)
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_yscale("log")
    ax.set_ylabel(f"TTFT ms (median of {result['repeats']})")
    ax.legend(fontsize=8)
    ax.set_title(f"time to first token, vLLM {result['vllm']}, {result['device']}", fontsize=9)


def _bytes_bars(ax, result: dict) -> None:
    shape = kv_shape_of(result)
    lengths = list(map(str, result["lengths"]))
    series = [("full attention", lambda n: shape.full_attention_bytes(int(n))),
              ("window bound", lambda n: shape.window_bound_bytes(int(n))),
              ("kvtier", lambda n: reload_bytes(result, "kvtier", n)),
              ("vLLM offload", lambda n: reload_bytes(result, "offload", n))]
    width = 0.8 / len(series)
    for i, (label, figure) in enumerate(series):
        values = [(figure(n) or 0) / (1 << 30) for n in lengths]
        bars = ax.bar([g + (i - 1.5) * width for g in range(len(lengths))], values, width, label=label)
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=7)
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_ylabel("GiB of KV per reload")
    ax.legend(fontsize=8)
    ax.set_title("KV bytes a reload moved", fontsize=9)
