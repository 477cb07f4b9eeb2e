"""``kvtier-bench engine``: kvtier inside a real CUDA vLLM, beside vLLM's own CPU offloading.

One run, one machine. Engines (each a process of its own session, ended through its group; see
:mod:`kvtier.bench.engine_child`), on a model with dummy weights (``--family``, see
:mod:`kvtier.bench.engine_model`: Llama-3-8B, or a Gemma-3-like model with sliding-window layers):

* ``none``: no connector: recompute and local prefix hit; the reference outputs;
* ``kvtier``: kvtier with a CPU tier; ``offload``: vLLM's ``OffloadingConnector``
  (``kv_offloading_size``) with a CPU tier of the same size. Each: recompute (first sight), local
  hit (same prompt again), reload (after ``reset_prefix_cache()``), per prompt length and repeat,
  and the KV bytes each reload moved, from the connector's own stats;
* ``disk``: a kvtier engine with a disk tier computes other prompts and exits, their chunk files
  leave the page cache, and a fresh engine on the same directory reloads them from disk, then
  again from its CPU tier (:mod:`kvtier.bench.engine_disk`; its own table and
  ``disk-<card>-<release>.json``).

Every TTFT is the wall time of ``generate(prompt, max_tokens=1)``, after unmeasured warm-ups
(a short prompt, then one prompt of each length computed and hit once). Then, in ``none``, ``kvtier``
and ``offload`` (not with ``--ttft-only``): prefill throughput (batches of new prompts, so kvtier
saves every chunk and nothing hits), a multi-turn chat whose sessions hold several times the
engine's KV cache, every session sent at once each round, and with ``--zero-hit`` the output rate
of unique prompts (:mod:`kvtier.bench.engine_busy`; ``--busy-only``: those two rows alone, which
also run on a CPU vLLM with a small ``--model``). Greedy outputs (16-token checks and
every chat reply) must be identical across engines. The raw pinned host-to-device memcpy rate is
measured first, in this process, for the reload floor ``local hit + KV bytes / memcpy rate``,
where the KV bytes are the window bound (:class:`~kvtier.bench.engine_model.KvShape`). The
report is :mod:`kvtier.bench.engine_report`'s.
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
from dataclasses import asdict

from kvtier import timeline
from kvtier.bench import engine_busy, engine_disk, engine_profile
from kvtier.bench.common import (Progress, add_cuda_graphs_flag, cpu_model, names_from, parse_tokens, positive,
                                 token_lengths, vllm_version)
from kvtier.bench.engine_model import FAMILIES, KvShape, read_kv_shape, read_max_positions, write_model_dir
from kvtier.bench.engine_report import MiB, format_table, loaded_bytes, reload_bytes, write_plot
from kvtier.bench.ttft import spawn

CHILD = "kvtier.bench.engine_child"
ENGINES = ("none", "kvtier", "offload", "disk")
CHECK_TOKENS = 16
CPU_BLOCK = 32  # tokens per block on a CPU vLLM: its attention takes multiples of 32
VOCAB = 120_000  # token ids drawn below every preset's vocabulary (Llama-3 128256, Gemma 3 262208)


def add_parser(commands) -> None:
    """Register ``kvtier-bench engine``."""
    p = commands.add_parser(
        "engine", help="CUDA vLLM with kvtier vs vLLM's OffloadingConnector vs no connector (TTFT, chat, prefill)",
        description="kvtier in a real CUDA vLLM (dummy weights: Llama-3-8B, or a Gemma-3-like sliding-window model): "
        "TTFT of recompute, local hit, CPU-tier and disk-tier reload against vLLM's OffloadingConnector, and the KV "
        "bytes each reload moved; a multi-turn chat beyond HBM; prefill throughput with kvtier saving; engine start; "
        "greedy outputs checked identical.")
    p.add_argument("--family", choices=FAMILIES, default=FAMILIES[0],
                   help="model preset, dummy weights (default llama3-8b; gemma3-like: 5 sliding-window layers "
                        "of 1024 tokens to 1 global, Gemma-3-12B's shape)")
    p.add_argument("--model", help="model directory (default: the --family preset's config; its weights, if any, not dummy ones)")
    p.add_argument("--prompt-lens", default="8k,32k", help="comma-separated TTFT prompt lengths (default 8k,32k)")
    p.add_argument("--repeats", type=positive, default=3, help="prompts per length and mode (default 3; median shown)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"engines to run, in this order, disk last (default {','.join(ENGINES)})")
    p.add_argument("--cpu-gib", type=positive, default=32,
                   help="CPU tier of kvtier and of vLLM's connector per TP rank, GiB (default 32)")
    p.add_argument("--tp", type=positive, default=1,
                   help="tensor-parallel size of every engine (default 1; needs that many GPUs)")
    p.add_argument("--hbm-tokens", type=parse_tokens, default=64 << 10,
                   help="engine KV cache, tokens (default 64k; with sliding-window layers, the bytes of that many "
                        "tokens' KV in every layer)")
    p.add_argument("--prefill-len", type=parse_tokens, default=8 << 10, help="prompt length of the prefill batches (default 8k)")
    p.add_argument("--prefill-batch", type=positive, default=8, help="prompts per prefill batch (default 8)")
    p.add_argument("--ttft-only", action="store_true", help="TTFT and bytes per reload only: no prefill, no chat")
    engine_busy.add_arguments(p)
    p.add_argument("--settle-s", type=float, default=1.0, help="pause before each local hit and reload (default 1)")
    p.add_argument("--local-repeats", type=positive, default=1,
                   help="local hits per prompt (default 1; at TP > 1 one engine's local hits spread by ±10 ms)")
    p.add_argument("--profile", metavar="DIR",
                   help="also run extra rounds, not measured, under vLLM's torch profiler (at the first length: a local "
                        "hit, the first reload after start, a later one; a prefill batch; a chat turn; 16 zero-hit "
                        "prompts), traces into DIR/<engine>/<round>, and report what grew between them")
    p.add_argument("--disk-io", choices=("buffered", "direct"), default="buffered",
                   help="the disk engine's disk_io (default buffered; direct: O_DIRECT reads)")
    p.add_argument("--disk-dir", metavar="DIR",
                   help="the disk engine's disk tier directory (default: in the run's temp dir); on a tmpfs (a faster "
                        "medium's stand-in) the result is named disk-<card>-<release>-tmpfs")
    p.add_argument("--disk-queue", type=int, default=0, metavar="N",
                   help="the disk engine also gets N prompts of the longest length on disk at once (default 0: none)")
    p.add_argument("--disk-results", metavar="DIR", default="bench/results",
                   help="where the disk engine's disk-<card>-<release>.json and .txt go (default bench/results)")
    add_cuda_graphs_flag(p)
    p.add_argument("--json", metavar="FILE", help="write every number to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="write a bar chart (needs matplotlib)")
    p.set_defaults(run=_main, parser=p)


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    lengths = [] if args.busy_only else token_lengths(parser, args.prompt_lens)
    engines = names_from(parser, args.engines, ENGINES)
    if args.busy_only and args.ttft_only:
        parser.error("argument --busy-only: not with --ttft-only (one leaves out what the other keeps).")
    if args.busy_only and "disk" in engines:
        parser.error("argument --engines: the disk engine has only TTFT rows, none with --busy-only.")
    if lengths and max(lengths) + 64 > args.hbm_tokens:
        parser.error(f"argument --hbm-tokens: {args.hbm_tokens} cannot hold a {max(lengths)}-token prompt.")
    engine_busy.check(parser, args)
    import torch

    if not torch.cuda.is_available() and not (args.busy_only and args.model):
        parser.error("kvtier-bench engine needs a CUDA GPU and a CUDA build of vLLM "
                     "(on a CPU vLLM only --busy-only with a small --model runs).")
    if torch.cuda.is_available() and args.tp > torch.cuda.device_count():
        parser.error(f"argument --tp: {args.tp} ranks need {args.tp} GPUs; {torch.cuda.device_count()} visible.")
    progress = Progress("engine")
    try:
        result = run(args, lengths, engines, progress)
    except RuntimeError as exc:
        print(f"kvtier-bench engine: error: {exc}", file=sys.stderr)
        return 1
    result["elapsed_s"] = progress.elapsed()
    print(format_table(result), flush=True)
    if "disk" in result:
        print(engine_disk.format_table(result["disk"]), flush=True)
        progress(f"wrote {engine_disk.write(result['disk'], args.disk_results)}")
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


def _profiled(round_: dict, tag: str) -> dict:
    """An extra round, not measured, run under the profiler as ``tag``."""
    return {**round_, "tag": ["profiled"], "profile": tag}


def _ttft_rounds(args, lengths: list[int], salt: int, reload: bool) -> list[dict]:
    # Unmeasured: a few decode steps (vLLM 0.26 at TP > 1 compiles its first one-token step, ~170 ms,
    # which serving pays on its first decode, and a bench of one-token answers on its first reload)
    rounds = [{"prompts": [prompt(1, 1024)], "max_tokens": 4, "tag": ["warmup"]}]
    for n in lengths:  # unmeasured: an engine's first short step over a long cached prefix took 100-150 ms at 8k
        rounds += [{"prompts": [prompt(400_000 + n, n)], "tag": ["warmup"]}] * 2  # computed, then a local hit
    profile = getattr(args, "profile", None)  # --profile: extra rounds of their own, at the first length
    profiled = prompt(salt + 777_777, lengths[0]) if profile else []
    if profile:
        rounds.append({"prompts": [profiled], "tag": ["warmup"]})
        # its local hit at once: after the rounds below a long prompt is no longer in the engine's prefix cache
        rounds.append(_profiled({"prompts": [profiled], "pause_s": args.settle_s}, "local"))
        if reload:
            rounds.append(_profiled({"prompts": [profiled], "reset": True, "pause_s": args.settle_s}, "reload-first"))
    for n in lengths:
        for r in range(args.repeats):
            p = prompt(salt + 1000 * r + n, n)
            rounds += [{"prompts": [p], "tag": ["recompute", n]}]
            rounds += [{"prompts": [p], "pause_s": args.settle_s, "tag": ["local", n]}] * getattr(args, "local_repeats", 1)
            if reload:
                rounds.append({"prompts": [p], "reset": True, "pause_s": args.settle_s, "tag": ["reload", n]})
        if profile and reload and n == lengths[0]:
            rounds.append(_profiled({"prompts": [profiled], "reset": True, "pause_s": args.settle_s}, "reload-later"))
    for n in lengths:
        p = prompt(7 + n, n)
        rounds.append({"prompts": [p], "max_tokens": CHECK_TOKENS, "tag": ["check", n]})
        if reload:
            rounds.append({"prompts": [p], "reset": True, "pause_s": args.settle_s, "max_tokens": CHECK_TOKENS,
                           "tag": ["check-reload", n]})
    return rounds


def _workload_rounds(args) -> list[dict]:
    batch = lambda b: [prompt(900_000 + 100 * b + i, args.prefill_len) for i in range(args.prefill_batch)]  # noqa: E731
    rounds = [{"prompts": batch(b), "reset": b == 0, "tag": ["prefill"]} for b in range(3)]
    if getattr(args, "profile", None):
        rounds.append(_profiled({"prompts": batch(3)}, "prefill"))
    return rounds + engine_busy.busy_rounds(args, prompt)


def engine_rounds(args, lengths: list[int], name: str) -> list[dict]:
    """The rounds engine ``name`` (none, kvtier or offload) runs: TTFT (reloads where it has a
    connector), then prefill, chat and zero-hit unless ``--ttft-only``; with ``--busy-only`` chat
    and zero-hit alone."""
    if getattr(args, "busy_only", False):
        return engine_busy.busy_rounds(args, prompt)
    rounds = _ttft_rounds(args, lengths, 0, reload=name != "none")
    return rounds if args.ttft_only else rounds + _workload_rounds(args)


def _spec(args, model: str, shape: KvShape, connector: str, rounds: list[dict], kvtier: dict | None = None,
          count_transfers: bool = False, cpu: bool = False, positions: int | None = None) -> dict:
    """An engine child's spec. The KV cache holds ``--hbm-tokens`` tokens of every layer's KV: as
    blocks of 16 tokens where every layer is full attention, as bytes where some are windowed
    (vLLM's hybrid manager then packs fewer layers in a block, and may still turn itself off).
    One block more than that: vLLM 0.33 keeps its null block out of the pool it checks a
    ``max_model_len`` prompt against. ``max_model_len``: that many tokens, or the model's
    ``positions`` (its ``max_position_embeddings``) where fewer: a pool larger than any prompt.
    ``cpu``: a CPU vLLM (``--busy-only`` with a small model): its attention takes blocks of 32
    tokens (its default is 128), and its ``gpu_memory_utilization`` is CPU memory reserved."""
    block = CPU_BLOCK if cpu else 16
    cache = ({"kv_cache_bytes": (args.hbm_tokens + block) * shape.token_bytes} if shape.sliding_layers
             else {"num_gpu_blocks": args.hbm_tokens // block + 1})
    return {"model": model, "connector": connector,
            "kvtier": kvtier or {"cpu_bytes": args.cpu_gib << 30, **args.kvtier_config},
            "offload_gib": args.cpu_gib * args.tp,  # vLLM's setting is split over its ranks; kvtier's is per rank
            **cache, "max_model_len": min(args.hbm_tokens, positions or args.hbm_tokens),
            "tp": args.tp, "cuda_graphs": args.cuda_graphs, "count_transfers": count_transfers, "rounds": rounds,
            **({"block_size": CPU_BLOCK, "gpu_memory_utilization": 0.1} if cpu else {})}


def run(args, lengths: list[int], engines: list[str], progress) -> dict:
    result = {"benchmark": "engine", "lengths": lengths, "repeats": args.repeats,
              "args": {k: v for k, v in vars(args).items() if k not in ("run", "parser")},
              "ttft_ms": {}, "start_s": {}, "prefill_tok_s": {}, "chat_s": {}, "checks": {}, "chat_tokens": {},
              "chat_reuse": {}, "reload_transfers": {}, "hybrid": {}, "chat_cached_tokens": {}, "zero_hit_tok_s": {}}
    profiles: dict[str, dict[str, list[dict]]] = {}  # engine -> profiled round -> per-rank summaries
    import torch

    cpu = not torch.cuda.is_available()  # a CPU vLLM: --busy-only with a small --model (_main's check)
    if cpu:
        result["device"], result["h2d_gbps"] = cpu_model(), None
    else:
        result["device"] = torch.cuda.get_device_name(0) + (f" × {args.tp} (TP={args.tp})" if args.tp > 1 else "")
        result["h2d_gbps"] = h2d_gbps()
        progress(f"{result['device']}: raw pinned H2D memcpy {result['h2d_gbps']:.1f} GB/s")
    with tempfile.TemporaryDirectory(prefix="kvtier-engine-") as tmp:
        model = args.model or write_model_dir(args.family, tmp)
        shape, positions = read_kv_shape(model), read_max_positions(model)
        result["model"] = args.model or args.family
        result["kv_shape"] = asdict(shape)
        result["kv_bytes_per_token"] = shape.token_bytes
        result["kv_bytes"] = {str(n): {"full_attention": shape.full_attention_bytes(n),
                                       "window_bound": shape.window_bound_bytes(n)} for n in lengths}
        result["vllm"] = vllm_version()
        progress(f"model {result['model']}: {shape.describe()}")
        for name in engine_busy.run_order([e for e in engines if e != "disk"], args.runs):  # as given, then reversed
            rounds = engine_rounds(args, lengths, name)
            progress(f"engine {name}: " + _plan(args, lengths))
            env = {"KVTIER_LOG_LEVEL": "DEBUG"} if name == "kvtier" else None  # one line per reload
            spec = _spec(args, model, shape, name, rounds, count_transfers=name != "none", cpu=cpu,
                         positions=positions)
            if args.profile:
                spec["profile_dir"] = os.path.join(os.path.abspath(args.profile), name)
            # a CPU vLLM (the tests' tiny model) runs in one process: it starts in seconds, not half a minute
            out, log = spawn(spec, tmp, name, timeout_s=1200, multiprocess=not cpu, module=CHILD, env=env)
            _collect(result, name, rounds, out)
            profiles[name] = {tag: engine_profile.summarize(paths) for tag, paths in out.get("profiles", {}).items()}
            if name == "kvtier":
                result["kvtier_load_ms"] = load_times(log)
                result["kvtier_stages_ms"], result["kvtier_first_load_stages_ms"] = load_stages(log, _reloads(rounds))
                result["kvtier_chat_stages_ms"] = chat_load_stages(log, _reloads(rounds))
                result["kvtier_start_lines"] = [m[0] for m in _STARTED.finditer(log)]  # what its start-up cost
            progress(f"engine {name}: started in {out['start_s']:.1f} s; " + _summary(result, name))
        if "disk" in engines:
            _run_disk(args, lengths, model, shape, positions, tmp, result, progress)
    result["identical"] = _identical(result)
    if args.profile:
        result["profile"] = {name: {tag: engine_profile.public(s) for tag, s in tags.items()}
                             for name, tags in profiles.items()}
        result["profile_compared"] = engine_profile.comparisons(profiles)
    return result


def _run_disk(args, lengths, model, shape, positions, tmp, result, progress) -> None:
    spec = lambda rounds, kvtier: _spec(args, model, shape, "kvtier", rounds, kvtier, count_transfers=True,  # noqa: E731
                                        positions=positions)
    read, out, result["disk"] = engine_disk.run(args, lengths, prompt, spec, tmp, progress)
    _collect(result, "disk", read, out)
    progress("engine disk: " + _summary(result, "disk"))


_STARTED = re.compile(r"kvtier (?:rank \d+(?:/\d+ on vLLM|: NIXL agent)|CPU tier: [\d.]+ GiB pinned) .*")
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
    result["hybrid"][name] = out.get("hybrid")
    got = iter(out["rounds"])
    ttft = result["ttft_ms"].setdefault(name, {})
    for rnd in rounds:
        tag = rnd["tag"]
        if engine_busy.collect(result, name, rnd, got, loaded_bytes):
            continue
        one = next(got)
        if tag[0] in ("recompute", "local", "reload", "disk"):
            ttft.setdefault(str(tag[1]), {}).setdefault(tag[0], []).append(one["seconds"] * 1e3)
            if tag[0] == "reload":  # the connector's stats for the round (None: it keeps none)
                result["reload_transfers"].setdefault(name, {}).setdefault(str(tag[1]), []).append(one.get("transfers"))
        elif tag[0].startswith("check"):
            result["checks"].setdefault(str(tag[1]), {})[f"{name}:{tag[0]}"] = one["outputs"][0]["tokens"]
        elif tag[0] == "prefill":
            tokens = sum(len(p) for p in rnd["prompts"])
            result["prefill_tok_s"].setdefault(name, []).append(tokens / one["seconds"])


def _reloads(rounds: list[dict]) -> int:
    """How many of ``rounds`` reload one prompt after a reset: the TTFT reloads, which come before
    the prefill and chat rounds (whose loads, among busy steps, are not a reload's time)."""
    return sum(1 for r in rounds if r.get("reset") and len(r.get("prompts", ())) == 1)


def _loads(log: str) -> list[dict]:
    """The timeline marks of each request that loaded something, in log order."""
    return [m for m in timeline.read(log.splitlines())[0].values() if "load seen" in m]


def _stage_ms(loads: list[dict]) -> dict[str, float]:
    """The median ms of each stage over ``loads`` (timeline marks per request)."""
    return {stage: round(v, 2) for stage, v, _ in timeline.stages(dict(enumerate(loads)), {})}


def load_stages(log: str, reloads: int | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """From an engine log's timeline marks: the median ms of each stage over the requests that
    loaded something (the first ``reloads`` of them, if given), and the same for the first of
    them (the first load after start)."""
    loaded = _loads(log)[:reloads]
    return _stage_ms(loaded), _stage_ms(loaded[:1])


def chat_load_stages(log: str, reloads: int) -> dict[str, float]:
    """The median ms of each stage over the loads that came after the first ``reloads`` (those of
    the chat: the prefill rounds' new prompts load nothing), and how many there were (``loads``)."""
    loaded = _loads(log)[reloads:]
    return {"loads": len(loaded), **_stage_ms(loaded)} if loaded else {}


def _identical(result: dict) -> bool:
    checks_same = all(len({tuple(t) for t in per.values()}) == 1 for per in result["checks"].values())
    chats = list(result["chat_tokens"].values())
    return checks_same and all(c == chats[0] for c in chats)


def _med(values) -> float:
    return statistics.median(values)


def _summary(result: dict, name: str) -> str:
    parts = [f"{n}: " + ", ".join(f"{m} {_med(v):.0f} ms" for m, v in modes.items())
             for n, modes in result["ttft_ms"].get(name, {}).items()]
    for n in result["reload_transfers"].get(name, {}):
        moved = reload_bytes(result, name, n)
        parts.append(f"{n}: a reload moved " + (f"{moved / MiB:.0f} MiB" if moved is not None else "n/a bytes"))
    if name in result["chat_s"]:
        parts.append(f"chat rounds 2+ {sum(result['chat_runs_s'][name][-1][1:]):.1f} s")  # this run's
    if name in result["prefill_tok_s"]:
        parts.append(f"prefill {_med(result['prefill_tok_s'][name]):.0f} tok/s")
    if name in result.get("zero_hit_tok_s", {}):
        parts.append(f"zero-hit {result['zero_hit_tok_s'][name]:.0f} output tok/s")
    return "; ".join(parts)


def _plan(args, lengths: list[int]) -> str:
    """What an engine is about to run, for the progress line."""
    parts = [] if args.busy_only else [f"TTFT at {', '.join(map(str, lengths))} tokens"]
    if not args.ttft_only:
        parts += [] if args.busy_only else ["prefill"]
        parts.append(f"{args.sessions}-session chat")
        parts += [f"{args.zero_hit} zero-hit prompts"] if args.zero_hit else []
    return ", ".join(parts)
