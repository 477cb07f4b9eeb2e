"""The reload benchmark's outputs: the plain-text table, the JSON record and the bar chart.

Each figure is one repeat's time (milliseconds), picked per path and direction by ``statistic``:
``best`` (the fastest repeat) or ``median``. A breakdown row (``kvtier.ops``) shows the repeat
its parent row (``kvtier``) picked, so the parts add up to the whole. GB/s is the prompt's KV
bytes over that time, 1 GB = 1e9 bytes; ``x raw`` is a path's GB/s over raw memcpy's GB/s in the
same direction.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os

from kvtier.bench.common import NO_MATPLOTLIB, make_parent, pyplot, save_figure
from kvtier.bench.reload_spec import ReloadResult
from kvtier.urls import redact

STATISTICS = ("best", "median")


def _gbps(nbytes: int, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else nbytes / (ms / 1e3) / 1e9


def _pick(samples: list[float], statistic: str) -> int | None:
    """Index of the repeat that ``statistic`` reports (the lower median for an even count)."""
    if not samples:
        return None
    order = sorted(range(len(samples)), key=samples.__getitem__)
    return order[0] if statistic == "best" else order[(len(order) - 1) // 2]


def _numbers(result: ReloadResult, statistic: str) -> dict[str, dict]:
    """Per path: ms, GB/s and ratio to raw memcpy for save and reload (None where absent)."""
    nbytes = result.spec.prompt_bytes
    out: dict[str, dict] = {}
    for name, times in result.paths.items():
        parent = result.paths.get(name.split(".")[0], times)
        row: dict = {"label": times.label.strip(), "note": times.note}
        for direction in ("save", "reload"):
            samples = getattr(times, f"{direction}_ms")
            index = _pick(getattr(parent, f"{direction}_ms"), statistic)
            ms = samples[index] if index is not None and index < len(samples) else None
            row[f"{direction}_ms"] = ms
            row[f"{direction}_gbps"] = _gbps(nbytes, ms)
            row[f"{direction}_ms_samples"] = list(samples)
        out[name] = row
    raw = out.get("raw")
    for row in out.values():
        for direction in ("save", "reload"):
            mine, ceiling = row[f"{direction}_gbps"], raw and raw[f"{direction}_gbps"]
            row[f"{direction}_vs_raw"] = mine / ceiling if mine and ceiling else None
    return out


def format_table(result: ReloadResult, statistic: str = "best") -> str:
    """The header lines, one aligned table (a row per path), verification, peak RSS and notes."""
    spec, g = result.spec, result.spec.geometry
    numbers = _numbers(result, statistic)
    notes: list[str] = []
    rows = []
    for name, times in result.paths.items():
        if name.count(".") and not name.startswith("kvtier"):
            continue  # sub-paths other than kvtier's breakdown go to the JSON only
        label = times.label
        if times.note and name != "raw":
            notes.append(times.note)
            label += f" [{len(notes)}]"
        n = numbers[name]
        rows.append([label] + [_fmt(n[k], d) for k, d in (
            ("save_gbps", 2), ("save_ms", 1), ("reload_gbps", 2), ("reload_ms", 1), ("save_vs_raw", 2), ("reload_vs_raw", 2))])
    head = ["path", "save GB/s", "save ms", "reload GB/s", "reload ms", "save x raw", "reload x raw"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "-" * len(line(head))
    top = [
        f"kvtier-bench reload on {spec.device} ({result.device_name}); ops backend {result.backend}; "
        f"load average {result.load_avg[0]:.2f} at start, {result.load_avg[1]:.2f} at end",
        f"geometry: {g.layers} layers x {g.kv_heads} KV heads x head dim {g.head_dim}, {str(g.dtype).removeprefix('torch.')}, "
        f"block {g.block_size} tokens, chunk {spec.chunk_tokens} tokens; {result.layout_kind} ({result.regions} regions)",
        f"bytes: {spec.prompt_tokens} tokens = {spec.prompt_blocks} blocks = {spec.num_chunks} chunks = "
        f"{spec.prompt_bytes} B ({_gib(spec.prompt_bytes)}); engine KV {2 * spec.prompt_blocks} blocks "
        f"({_gib(2 * spec.prompt_bytes)}); CPU tier {_gib(result.cpu_tier_bytes)}"
        + (f"; disk tier {spec.disk_path}" if spec.disk_path else "")
        + (f"; shared tier {redact(spec.shared_url)}" if spec.shared_url else ""),
        f"{statistic} of {spec.repeats} repeats (breakdown rows: the repeat their path picked); "
        "GB/s = bytes / time (1 GB = 1e9 B); x raw = GB/s / raw memcpy GB/s",
    ]
    bottom = [
        "verified byte for byte (reloaded blocks == saved blocks): " + ", ".join(result.verified),
        f"peak RSS {_gib(result.peak_rss_bytes)}; bench wall time {result.elapsed_s:.0f} s" + _interference(result),
        "kvtier save = TierWorker.save + drain (gather, checksum + header, put); "
        "reload = TierWorker.load (get, checksum verify, scatter)",
    ]
    shared, raw_get, gets = numbers.get("shared"), numbers.get("shared_raw"), numbers.get("shared.storage")
    if shared and raw_get and gets and shared["reload_ms"] and raw_get["reload_ms"] and gets["reload_ms"]:
        n = spec.num_chunks
        bottom.append(f"shared tier per chunk: reload {shared['reload_ms'] / n:.2f} ms, of which store get "
                      f"{gets['reload_ms'] / n:.2f} ms; raw GET {raw_get['reload_ms'] / n:.2f} ms (store get = "
                      f"{raw_get['reload_ms'] / gets['reload_ms']:.2f} x raw GET's GB/s; whole reload "
                      f"{raw_get['reload_ms'] / shared['reload_ms']:.2f} x)")
    for b in result.beside_gemm or ():
        bottom.append(f"beside a bf16 GEMM loop, {b.path}: GEMMs {b.gemm_alone_tflops:.0f} -> {b.gemm_tflops:.0f} "
                      f"TFLOP/s ({b.slowdown_pct:.1f}% slower) while it moved {b.copy_gbps:.1f} GB/s "
                      f"(save {b.save_gbps:.1f}, reload {b.reload_gbps:.1f}; {b.copies} runs in the window)")
    bottom += [f"[{i}] {note}" for i, note in enumerate(notes, 1)]
    return "\n".join([*top, rule, line(head), rule, *map(line, rows), rule, *bottom])


def to_json(result: ReloadResult, statistic: str = "best") -> dict:
    spec, g = result.spec, result.spec.geometry
    numbers = _numbers(result, statistic)
    return {
        "benchmark": "reload",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"type": spec.device.type, "name": result.device_name},
        "backend": result.backend,
        "geometry": {
            "layers": g.layers, "kv_heads": g.kv_heads, "head_dim": g.head_dim,
            "dtype": str(g.dtype).removeprefix("torch."), "block_size": g.block_size,
            "chunk_tokens": spec.chunk_tokens, "prompt_tokens": spec.prompt_tokens,
            "prompt_blocks": spec.prompt_blocks, "engine_blocks": 2 * spec.prompt_blocks,
            "layout": result.layout_kind, "regions": result.regions,
        },
        "bytes": spec.prompt_bytes,
        "cpu_tier_bytes": result.cpu_tier_bytes,
        "disk_path": spec.disk_path,
        "shared_url": redact(spec.shared_url) if spec.shared_url else None,
        "repeats": spec.repeats,
        "statistic": statistic,
        "units": {"ms": "milliseconds", "gbps": "1e9 bytes per second", "vs_raw": "GB/s over raw memcpy GB/s"},
        "results": numbers,
        "verified": bool(result.verified) and "kvtier" in result.verified,
        "verified_paths": result.verified,
        "peak_rss_bytes": result.peak_rss_bytes,
        "load_avg_1min": {"start": result.load_avg[0], "end": result.load_avg[1]},
        "others_cpu_s": result.others_cpu_s,
        "elapsed_s": result.elapsed_s,
        "beside_gemm": None if result.beside_gemm is None else [
            {**dataclasses.asdict(b), "slowdown_pct": b.slowdown_pct} for b in result.beside_gemm],
    }


def write_json(result: ReloadResult, path: str, statistic: str = "best") -> None:
    make_parent(path)
    with open(path, "w") as f:
        json.dump(to_json(result, statistic), f, indent=2)
        f.write("\n")


def write_plot(result: ReloadResult, path: str, statistic: str = "best") -> str | None:
    """Bar chart of GB/s per path (left) and kvtier's time breakdown (right) as a PNG.

    Returns None, or the reason the plot was skipped (matplotlib missing).
    """
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    numbers = _numbers(result, statistic)
    main = [name for name in numbers if "." not in name or name == "kvtier.ops"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.38
    for offset, direction in ((-width / 2, "save"), (width / 2, "reload")):
        values = [numbers[n][f"{direction}_gbps"] or 0.0 for n in main]
        bars = left.bar([i + offset for i in range(len(main))], values, width, label=direction)
        left.bar_label(bars, labels=[f"{v:.1f}" if v else "" for v in values], fontsize=8)
    labels = ["kvtier, ops only" if n == "kvtier.ops" else numbers[n]["label"] for n in main]
    left.set_xticks(range(len(main)), [label.replace(", ", ",\n", 1) for label in labels], fontsize=8)
    left.set_ylabel(f"GB/s ({statistic} of {result.spec.repeats})")
    left.legend()
    parts = [("kvtier.ops", "ops (gather/scatter)"), ("kvtier.storage", "store"), ("kvtier.rest", "checksum + rest")]
    bottoms = [0.0, 0.0]
    for name, label in parts:
        values = [numbers[name]["save_ms"] or 0.0, numbers[name]["reload_ms"] or 0.0]
        right.bar(["save", "reload"], values, 0.5, bottom=bottoms, label=label)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    right.set_ylabel("ms")
    right.set_title("kvtier, CPU tier: where the time goes", fontsize=10)
    right.legend(fontsize=8)
    spec, g = result.spec, result.spec.geometry
    fig.suptitle(
        f"kvtier reload, {spec.prompt_tokens} tokens ({_gib(spec.prompt_bytes)}), {g.layers}L x {g.kv_heads}H x {g.head_dim}, "
        f"{str(g.dtype).removeprefix('torch.')} on {result.device_name}", fontsize=10,
    )
    save_figure(fig, path)
    return None


def _interference(result: ReloadResult) -> str:
    if result.others_cpu_s is None:
        return ""
    text = f"; other processes used {result.others_cpu_s:.1f} CPU-s meanwhile"
    if result.others_cpu_s > max(1.0, 0.1 * result.elapsed_s * (os.cpu_count() or 1)):
        text += " (WARNING: a busy machine; torch's multi-threaded copies suffer most - rerun on a quiet one)"
    return text


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"
