"""``kvtier-bench engine``: kvtier inside a real CUDA vLLM, beside vLLM's own CPU offloading.

One run, one machine. Engines (each a process of its own session, ended through its group; see
:mod:`kvtier.bench.engine_child`), on a Llama-3-8B-shaped model with dummy weights:

* ``none``: no connector: recompute and local prefix hit; the reference outputs;
* ``kvtier``: kvtier with a CPU tier; ``offload``: vLLM's ``OffloadingConnector``
  (``kv_offloading_size``) with a CPU tier of the same size. Each: recompute (first sight), local
  hit (same prompt again), reload (after ``reset_prefix_cache()``), per prompt length and repeat;
* ``disk``: a kvtier engine with a disk tier computes other prompts and exits, their chunk files
  leave the page cache, and a fresh engine on the same directory reloads them from disk.

Every TTFT is the wall time of ``generate(prompt, max_tokens=1)``. Then, in ``none``, ``kvtier``
and ``offload``: prefill throughput (batches of new prompts, so kvtier saves every chunk and
nothing hits), and a multi-turn chat whose sessions hold several times the engine's KV cache,
every session sent at once each round. Greedy outputs (16-token checks and every chat reply) must
be identical across engines. The raw pinned host-to-device memcpy rate is measured first, in this
process, for the reload floor ``local hit + KV bytes / memcpy rate``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time

from kvtier.bench.common import (NO_MATPLOTLIB, Progress, names_from, parse_tokens, positive, pyplot, save_figure,
                                 token_lengths, vllm_version)
from kvtier.bench.ttft import spawn
from kvtier.bench.ttft_tiers import drop_page_cache

CHILD = "kvtier.bench.engine_child"
ENGINES = ("none", "kvtier", "offload", "disk")
CHECK_TOKENS = 16
VOCAB = 120_000  # token ids drawn below Llama-3's vocabulary
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 65536,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16", "bos_token_id": 1,
             "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu"}


def add_parser(commands) -> None:
    """Register ``kvtier-bench engine``."""
    p = commands.add_parser(
        "engine", help="CUDA vLLM with kvtier vs vLLM's OffloadingConnector vs no connector (TTFT, chat, prefill)",
        description="kvtier in a real CUDA vLLM (dummy-weight Llama-3-8B): TTFT of recompute, local hit, CPU-tier "
        "and disk-tier reload against vLLM's OffloadingConnector; a multi-turn chat beyond HBM; prefill throughput "
        "with kvtier saving; engine start; greedy outputs checked identical.")
    p.add_argument("--model", help="model directory (default: a Llama-3-8B config, dummy weights)")
    p.add_argument("--prompt-lens", default="8k,32k", help="comma-separated TTFT prompt lengths (default 8k,32k)")
    p.add_argument("--repeats", type=positive, default=3, help="prompts per length and mode (default 3; median shown)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"which engines to run (default {','.join(ENGINES)})")
    p.add_argument("--cpu-gib", type=positive, default=32, help="CPU tier of kvtier and of vLLM's connector, GiB (default 32)")
    p.add_argument("--hbm-tokens", type=parse_tokens, default=64 << 10, help="engine KV cache, tokens (default 64k)")
    p.add_argument("--sessions", type=positive, default=32, help="chat sessions (default 32)")
    p.add_argument("--session-len", type=parse_tokens, default=6 << 10, help="first prompt of a session (default 6k)")
    p.add_argument("--chat-rounds", type=positive, default=4, help="chat rounds (default 4; rounds 2+ are timed)")
    p.add_argument("--prefill-len", type=parse_tokens, default=8 << 10, help="prompt length of the prefill batches (default 8k)")
    p.add_argument("--prefill-batch", type=positive, default=8, help="prompts per prefill batch (default 8)")
    p.add_argument("--settle-s", type=float, default=1.0, help="pause before each local hit and reload (default 1)")
    p.add_argument("--json", metavar="FILE", help="write every number to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="write a bar chart (needs matplotlib)")
    p.set_defaults(run=_main, parser=p)


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    lengths = token_lengths(parser, args.prompt_lens)
    engines = names_from(parser, args.engines, ENGINES)
    if max(lengths) + 64 > args.hbm_tokens:
        parser.error(f"argument --hbm-tokens: {args.hbm_tokens} cannot hold a {max(lengths)}-token prompt.")
    import torch

    if not torch.cuda.is_available():
        parser.error("kvtier-bench engine needs a CUDA GPU and a CUDA build of vLLM.")
    progress = Progress("engine")
    try:
        result = run(args, lengths, engines, progress)
    except RuntimeError as exc:
        print(f"kvtier-bench engine: error: {exc}", file=sys.stderr)
        return 1
    result["elapsed_s"] = progress.elapsed()
    print(format_table(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        progress(f"wrote {args.json}")
    if args.plot:
        progress(write_plot(result, args.plot) or f"wrote {args.plot}")
    return 0 if result["identical"] else 1


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB) for _ in range(length)]


def h2d_gbps(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Raw pinned host-to-device ``copy_`` rate, GB/s (best of ``repeats``)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - begin)
    del host, device
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def kv_bytes_per_token(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 2  # K and V, 16-bit


def _ttft_rounds(args, lengths: list[int], salt: int, reload: bool) -> list[dict]:
    rounds = [{"prompts": [prompt(1, 1024)], "tag": ["warmup"]}]
    for n in lengths:
        for r in range(args.repeats):
            p = prompt(salt + 1000 * r + n, n)
            rounds += [{"prompts": [p], "tag": ["recompute", n]},
                       {"prompts": [p], "pause_s": args.settle_s, "tag": ["local", n]}]
            if reload:
                rounds.append({"prompts": [p], "reset": True, "pause_s": args.settle_s, "tag": ["reload", n]})
    for n in lengths:
        p = prompt(7 + n, n)
        rounds.append({"prompts": [p], "max_tokens": CHECK_TOKENS, "tag": ["check", n]})
        if reload:
            rounds.append({"prompts": [p], "reset": True, "pause_s": args.settle_s, "max_tokens": CHECK_TOKENS,
                           "tag": ["check-reload", n]})
    return rounds


def _workload_rounds(args) -> list[dict]:
    rounds = [{"prompts": [prompt(900_000 + 100 * b + i, args.prefill_len) for i in range(args.prefill_batch)],
               "reset": b == 0, "tag": ["prefill"]} for b in range(3)]
    sessions = [prompt(500_000 + s, args.session_len) for s in range(args.sessions)]
    turns = [[prompt(600_000 + 1000 * t + s, 128) for s in range(args.sessions)] for t in range(args.chat_rounds)]
    rounds.append({"sessions": sessions, "turns": turns, "max_tokens": 32, "reset": True, "tag": ["chat"]})
    return rounds


def _spec(args, model: str, connector: str, rounds: list[dict], kvtier: dict | None = None) -> dict:
    return {"model": model, "connector": connector, "kvtier": kvtier or {"cpu_bytes": args.cpu_gib << 30},
            "offload_gib": args.cpu_gib, "num_gpu_blocks": args.hbm_tokens // 16,
            "max_model_len": args.hbm_tokens, "rounds": rounds}


def run(args, lengths: list[int], engines: list[str], progress) -> dict:
    result = {"benchmark": "engine", "lengths": lengths, "repeats": args.repeats,
              "args": {k: v for k, v in vars(args).items() if k not in ("run", "parser")},
              "ttft_ms": {}, "start_s": {}, "prefill_tok_s": {}, "chat_s": {}, "checks": {}, "chat_tokens": {}}
    import torch

    result["device"] = torch.cuda.get_device_name(0)
    result["h2d_gbps"] = h2d_gbps()
    progress(f"{result['device']}: raw pinned H2D memcpy {result['h2d_gbps']:.1f} GB/s")
    with tempfile.TemporaryDirectory(prefix="kvtier-engine-") as tmp:
        model = args.model
        if model is None:
            model = os.path.join(tmp, "llama3-8b")
            os.makedirs(model)
            with open(os.path.join(model, "config.json"), "w") as f:
                json.dump(LLAMA3_8B, f)
        result["kv_bytes_per_token"] = kv_bytes_per_token(model)
        result["vllm"] = vllm_version()
        for name in (e for e in ("none", "kvtier", "offload") if e in engines):
            rounds = _ttft_rounds(args, lengths, 0, reload=name != "none") + _workload_rounds(args)
            progress(f"engine {name}: TTFT at {', '.join(map(str, lengths))} tokens, prefill, {args.sessions}-session chat")
            env = {"KVTIER_LOG_LEVEL": "DEBUG"} if name == "kvtier" else None  # one line per reload
            out, log = spawn(_spec(args, model, name, rounds), tmp, name, timeout_s=1200, multiprocess=True,
                             module=CHILD, env=env)
            _collect(result, name, rounds, out)
            if name == "kvtier":
                result["kvtier_load_ms"] = load_times(log)
            progress(f"engine {name}: started in {out['start_s']:.1f} s; " + _summary(result, name))
        if "disk" in engines:
            _run_disk(args, lengths, model, tmp, result, progress)
    result["identical"] = _identical(result)
    return result


def _run_disk(args, lengths, model, tmp, result, progress) -> None:
    disk = os.path.join(tmp, "disk")
    config = {"cpu_bytes": 8 << 30, "disk_path": disk, "disk_bytes": 48 << 30}
    write = [{"prompts": [prompt(300_000 + 1000 * r + n, n)], "tag": ["write", n]}
             for n in lengths for r in range(args.repeats)]
    write += [{"prompts": [prompt(7 + n, n)], "tag": ["write", n]} for n in lengths]
    progress("engine disk-write: computes the disk prompts (written through to the disk tier)")
    spawn(_spec(args, model, "kvtier", write, config), tmp, "disk-write", timeout_s=900, multiprocess=True, module=CHILD)
    progress(f"dropped {drop_page_cache(disk)} chunk files from the page cache; engine disk (fresh, same directory)")
    read = [{"prompts": [prompt(1, 1024)], "tag": ["warmup"]}]
    read += [{"prompts": [prompt(400_000 + n, n)], "tag": ["warmup"]} for n in lengths]  # long-context first steps
    read += [{"prompts": [prompt(300_000 + 1000 * r + n, n)], "tag": ["disk", n]}
             for n in lengths for r in range(args.repeats)]
    read += [{"prompts": [prompt(7 + n, n)], "max_tokens": CHECK_TOKENS, "tag": ["check-disk", n]} for n in lengths]
    out, _ = spawn(_spec(args, model, "kvtier", read, config), tmp, "disk", timeout_s=900, multiprocess=True, module=CHILD)
    _collect(result, "disk", read, out)
    progress("engine disk: " + _summary(result, "disk"))


_LOADED = re.compile(r"loaded (\d+) of \d+ blocks \((\d+) tokens from cpu\) in ([\d.]+) ms")


def load_times(log: str) -> dict[str, list[float]]:
    """kvtier's own time per CPU-tier load (its worker's DEBUG lines: from the load's start to its
    last copy's end), by tokens loaded: the part of a reload's TTFT that is kvtier's copy."""
    times: dict[str, list[float]] = {}
    for _, tokens, ms in _LOADED.findall(log):
        times.setdefault(tokens, []).append(float(ms))
    return times


def _collect(result: dict, name: str, rounds: list[dict], out: dict) -> None:
    result["start_s"][name] = out["start_s"]
    got = iter(out["rounds"])
    ttft = result["ttft_ms"].setdefault(name, {})
    for rnd in rounds:
        tag = rnd["tag"]
        if tag[0] == "chat":
            chat = [next(got) for _ in rnd["turns"]]
            result["chat_s"][name] = [c["seconds"] for c in chat]
            result["chat_tokens"][name] = [[o["tokens"] for o in c["outputs"]] for c in chat]
            continue
        one = next(got)
        if tag[0] in ("recompute", "local", "reload", "disk"):
            ttft.setdefault(str(tag[1]), {}).setdefault(tag[0], []).append(one["seconds"] * 1e3)
        elif tag[0].startswith("check"):
            result["checks"].setdefault(str(tag[1]), {})[f"{name}:{tag[0]}"] = one["outputs"][0]["tokens"]
        elif tag[0] == "prefill":
            tokens = sum(len(p) for p in rnd["prompts"])
            result["prefill_tok_s"].setdefault(name, []).append(tokens / one["seconds"])


def _identical(result: dict) -> bool:
    checks_same = all(len({tuple(t) for t in per.values()}) == 1 for per in result["checks"].values())
    chats = list(result["chat_tokens"].values())
    return checks_same and all(c == chats[0] for c in chats)


def _med(values) -> float:
    return statistics.median(values)


def _summary(result: dict, name: str) -> str:
    parts = [f"{n}: " + ", ".join(f"{m} {_med(v):.0f} ms" for m, v in modes.items())
             for n, modes in result["ttft_ms"].get(name, {}).items()]
    if name in result["chat_s"]:
        parts.append(f"chat rounds 2+ {sum(result['chat_s'][name][1:]):.1f} s")
    if name in result["prefill_tok_s"]:
        parts.append(f"prefill {_med(result['prefill_tok_s'][name]):.0f} tok/s")
    return "; ".join(parts)


def format_table(result: dict) -> str:
    ms = result["ttft_ms"]
    lines = [f"kvtier-bench engine: vLLM {result['vllm']} on {result['device']}; TTFT ms, median of {result['repeats']}; "
             f"raw pinned H2D {result['h2d_gbps']:.1f} GB/s; KV {result['kv_bytes_per_token'] >> 10} KiB/token"]
    head = (f"{'tokens':>6} {'recompute':>9} {'local':>6} {'kvtier cpu':>10} {'kvtier disk':>11} {'vLLM offload':>12} "
            f"{'target':>6}  kvtier/vLLM  kvtier/target")
    lines += [head, "-" * len(head)]
    for n in map(str, result["lengths"]):
        def cell(engine: str, mode: str) -> float | None:
            values = ms.get(engine, {}).get(n, {}).get(mode)
            return _med(values) if values else None

        local = cell("none", "local") or cell("kvtier", "local")
        kv, off = cell("kvtier", "reload"), cell("offload", "reload")
        target = None if local is None else local + 1.1 * copy_ms(result, int(n))
        fmt = lambda v, w: f"{v:>{w}.0f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
        lines.append(f"{n:>6} {fmt(cell('none', 'recompute'), 9)} {fmt(local, 6)} {fmt(kv, 10)} "
                     f"{fmt(cell('disk', 'disk'), 11)} {fmt(off, 12)} {fmt(target, 6)}  {ratio(kv, off):>11}  {ratio(kv, target):>13}")
    loads = result.get("kvtier_load_ms") or {}
    if loads:
        lines.append("where a kvtier reload's time goes (median ms): " + "; ".join(
            f"{n} tokens: load in the worker {_med(loads[n]):.0f} (raw H2D of its bytes {copy_ms(result, int(n)):.0f})"
            for n in map(str, result["lengths"]) if n in loads))
    if result["chat_s"]:
        lines.append("multi-turn chat, rounds 2+ (s): " + ", ".join(
            f"{k} {sum(v[1:]):.2f}" for k, v in result["chat_s"].items()))
    if result["prefill_tok_s"]:
        base = result["prefill_tok_s"].get("none")
        lines.append("prefill tok/s (median of 3 batches): " + ", ".join(
            f"{k} {_med(v):.0f}" + (f" ({_med(v) / _med(base):.3f} x none)" if base and k != "none" else "")
            for k, v in result["prefill_tok_s"].items()))
    lines.append("engine start (s): " + ", ".join(f"{k} {v:.1f}" for k, v in result["start_s"].items()))
    lines.append("greedy outputs identical across engines (16-token checks, every chat reply): "
                 + ("yes" if result["identical"] else "NO"))
    lines.append("targets: kvtier cpu <= vLLM offload; kvtier cpu <= target = local + 1.1 x (KV bytes / raw pinned H2D); "
                 "chat rounds 2+ <= vLLM's; prefill >= 0.98 x none; start <= vLLM's + 5 s")
    return "\n".join(lines)


def copy_ms(result: dict, tokens: int) -> float:
    """Milliseconds the raw pinned host-to-device memcpy takes for ``tokens`` tokens' KV."""
    return tokens * result["kv_bytes_per_token"] / result["h2d_gbps"] / 1e6


def write_plot(result: dict, path: str) -> str | None:
    """TTFT bars per length and mode, and chat rounds 2+ per engine. None or why skipped."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    modes = [("none", "recompute", "recompute"), ("none", "local", "local hit"), ("kvtier", "reload", "kvtier cpu"),
             ("disk", "disk", "kvtier disk"), ("offload", "reload", "vLLM offload")]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
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
    names = list(result["chat_s"])
    bars = bx.bar(names, [sum(result["chat_s"][k][1:]) for k in names], color="tab:gray")
    bx.bar_label(bars, fmt="%.1f", fontsize=8)
    bx.set_ylabel("seconds, chat rounds 2+")
    bx.set_title("multi-turn chat beyond HBM", fontsize=9)
    save_figure(fig, path)
    return None
