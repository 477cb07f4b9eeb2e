"""``kvtier-bench overhead``: what kvtier costs when it never helps.

A mixed batch with no prefix hits: ``--short`` short requests decoding ``--decode`` tokens each
while ``--long`` long prompts of ``--long-len`` tokens prefill beside them (chunked prefill,
``--max-batched`` tokens per step). The same engine runs it without a KV connector and with
kvtier saving every full chunk of every prompt (CPU tier), alternately, each engine in a process
of its own session; every round uses new prompts. Throughput = (prompt + generated tokens) /
wall time of the round's ``generate``; the figure is kvtier's median over the baseline's median.

In-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the engine thread's time inside
kvtier's hooks is measured too: ``wait_for_save`` (the copy of new chunks out of the engine's
blocks; storing them runs on kvtier's save thread), ``start_load_kv`` and ``get_finished``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field

from kvtier.bench.common import NO_MATPLOTLIB, Progress, parse_tokens, positive, pyplot, save_figure
from kvtier.bench.ttft import kv_bytes_per_token, make_model, prompt, spawn

ENGINES = ("none", "kvtier")


@dataclass(slots=True)
class OverheadResult:
    """``tokens_per_s[engine]``: one sample per round; ``hooks_ms``: kvtier's engine-thread time
    per hook, summed over all its rounds; ``tokens_per_round``: prompt plus generated tokens."""

    tokens_per_round: int
    rounds: int
    tokens_per_s: dict = field(default_factory=lambda: {e: [] for e in ENGINES})
    wall_s: dict = field(default_factory=lambda: {e: 0.0 for e in ENGINES})
    hooks_ms: dict = field(default_factory=dict)
    identical: bool = True
    load_avg: list[float] = field(default_factory=list)


def add_parser(commands) -> None:
    """Register ``kvtier-bench overhead``."""
    p = commands.add_parser(
        "overhead", help="tokens/s of a mixed batch with no hits: kvtier saving every chunk vs no connector",
        description="Throughput of many short decoding requests beside long prefills, no prefix hits, with kvtier "
        "saving every chunk against the same engine without a KV connector, alternately in one run.")
    p.add_argument("--short", type=positive, default=16, help="short requests per round (default 16)")
    p.add_argument("--short-len", type=parse_tokens, default=64, help="short prompt tokens (default 64)")
    p.add_argument("--decode", type=positive, default=64, help="tokens each short request generates (default 64)")
    p.add_argument("--long", type=positive, default=2, help="long prompts per round (default 2)")
    p.add_argument("--long-len", type=parse_tokens, default=4 << 10, help="long prompt tokens (default 4k)")
    p.add_argument("--max-batched", type=positive, default=512, help="tokens per engine step (default 512)")
    p.add_argument("--rounds", type=positive, default=3, help="timed rounds per engine start (default 3)")
    p.add_argument("--alternations", type=positive, default=2,
                   help="times each engine is started, alternately (default 2)")
    p.add_argument("--chunk-tokens", type=positive, default=256, help="kvtier chunk (default 256)")
    p.add_argument("--hidden", type=positive, default=384, help="model width (default 384)")
    p.add_argument("--layers", type=positive, default=6, help="model depth (default 6)")
    p.add_argument("--json", metavar="FILE", help="write every number to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="write a bar chart (needs matplotlib)")
    p.set_defaults(run=_main, parser=p)


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    progress = Progress("overhead")
    try:
        result = run(args, progress)
    except RuntimeError as exc:
        print(f"kvtier-bench overhead: error: {exc}", file=sys.stderr)
        return 1
    print(format_table(result, args), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(result, args), f, indent=1)
        progress(f"wrote {args.json}")
    if args.plot:
        progress(write_plot(result, args.plot) or f"wrote {args.plot}")
    return 0 if result.identical else 1


def _rounds(args, seed: int) -> list[dict]:
    """Warm-up, then ``args.rounds`` mixed batches of new prompts (same prompts for both engines)."""
    out = [{"prompts": [prompt(seed + 9_999, 128)], "max_tokens": 4}]
    for r in range(args.rounds):
        base = seed + 1_000 * (r + 1)
        longs = [prompt(base + i, args.long_len) for i in range(args.long)]
        shorts = [prompt(base + 100 + i, args.short_len) for i in range(args.short)]
        out.append({"prompts": shorts + longs, "max_tokens": args.decode, "timed": True})
    return out


def run(args, progress) -> OverheadResult:
    generated = args.short * args.decode + args.long * args.decode
    per_round = args.short * args.short_len + args.long * args.long_len + generated
    result = OverheadResult(per_round, args.rounds)
    max_len = max(args.long_len, args.short_len) + args.decode + 64
    kv_bytes = max(256 << 20, 2 * (args.long * args.long_len + args.short * (args.short_len + args.decode))
                   * kv_bytes_per_token(args.hidden, args.layers))
    tokens: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-overhead-") as tmp:
        progress("building a random-weight Llama")
        model = make_model(os.path.join(tmp, "model"), args.hidden, args.layers, max(8192, 2 * max_len))
        for a in range(args.alternations):
            for engine in ENGINES:
                kvtier = {"chunk_tokens": args.chunk_tokens, "cpu_bytes": 2 << 30} if engine == "kvtier" else None
                spec = {"model": model, "kvtier": kvtier, "block_size": 32, "max_batched": args.max_batched,
                        "kv_bytes": kv_bytes, "max_model_len": max_len, "max_num_seqs": args.short + args.long,
                        "time_connector": engine == "kvtier", "rounds": _rounds(args, 10_000 * (a + 1))}
                progress(f"{engine} {a + 1}/{args.alternations}: {args.rounds} rounds of {args.short} x "
                         f"{args.short_len}+{args.decode} and {args.long} x {args.long_len} tokens")
                out, _ = spawn(spec, tmp, f"{engine}-{a}")
                result.load_avg.append(os.getloadavg()[0])
                for rnd, got in zip(spec["rounds"], out["rounds"]):
                    if rnd.get("timed"):
                        result.tokens_per_s[engine].append(per_round / got["seconds"])
                        result.wall_s[engine] += got["seconds"]
                        tokens.setdefault(engine, []).append([o["tokens"] for o in got["outputs"]])
                for key, value in (out.get("connector_ms") or {}).items():
                    result.hooks_ms[key] = result.hooks_ms.get(key, 0.0) + value
                progress(f"{engine} {a + 1}/{args.alternations}: "
                         + ", ".join(f"{v:.0f}" for v in result.tokens_per_s[engine][-args.rounds:]) + " tokens/s")
    result.identical = tokens.get("none") == tokens.get("kvtier")
    return result


def format_table(result: OverheadResult, args) -> str:
    med = {e: statistics.median(v) for e, v in result.tokens_per_s.items()}
    ratio = med["kvtier"] / med["none"]
    lines = [f"kvtier-bench overhead: per round {args.short} short ({args.short_len} prompt + {args.decode} generated tokens) "
             f"and {args.long} long ({args.long_len} tokens) requests, new prompts (no hits), {args.max_batched} tokens/step; "
             f"in-process engines; load average {', '.join(f'{x:.2f}' for x in result.load_avg)} (1 min, after each engine)",
             f"{'engine':<34} {'tokens/s (median)':>18} {'best':>8} {'samples':>8}"]
    labels = {"none": "no KV connector", "kvtier": "kvtier, saving every chunk (CPU tier)"}
    for engine in ENGINES:
        v = result.tokens_per_s[engine]
        lines.append(f"{labels[engine]:<34} {med[engine]:>18,.0f} {max(v):>8,.0f} {len(v):>8}")
    lines.append(f"kvtier / no connector: {ratio:.3f} (target >= 0.97)")
    hooks = result.hooks_ms
    wall = result.wall_s["kvtier"] * 1e3
    if hooks and wall:
        parts = []
        hook_names = sorted((k for k in hooks if not k.endswith(".calls") and k != "save"), key=lambda k: -hooks[k])
        for key in hook_names:
            parts.append(f"{key} {hooks[key]:.0f} ms in {int(hooks.get(key + '.calls', 0))} calls "
                         f"({100 * hooks[key] / wall:.1f}%)")
        total = sum(hooks[k] for k in hook_names if k != "save.gather")  # the gather runs inside wait_for_save
        lines.append(f"kvtier's engine-thread time over the timed rounds' wall time: {100 * total / wall:.1f}% in all: "
                     + "; ".join(parts))
    lines.append("greedy outputs identical with and without kvtier: " + ("yes" if result.identical else "NO"))
    return "\n".join(lines)


def to_json(result: OverheadResult, args) -> dict:
    return {"benchmark": "overhead", "args": {k: v for k, v in vars(args).items() if k not in ("run", "parser")},
            "tokens_per_round": result.tokens_per_round, "tokens_per_s": result.tokens_per_s,
            "wall_s": result.wall_s, "hooks_ms": result.hooks_ms, "identical": result.identical,
            "load_avg_1min": result.load_avg}


def write_plot(result: OverheadResult, path: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, engine in enumerate(ENGINES):
        v = result.tokens_per_s[engine]
        ax.bar(i, statistics.median(v), 0.6, label=engine)
        ax.scatter([i] * len(v), v, color="black", s=8, zorder=3)
    ax.set_xticks(range(len(ENGINES)), ["no KV connector", "kvtier saving every chunk"])
    ax.set_ylabel("tokens/s (bars: median; dots: rounds)")
    ax.set_title("mixed batch, no hits: what kvtier costs", fontsize=10)
    save_figure(fig, path)
    return None
