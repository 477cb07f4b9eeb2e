"""``kvtier-bench engine``'s rows of a busy engine: the multi-turn chat and the zero-hit row.

Chat: ``--sessions`` sessions, each a unique context of ``--session-len`` tokens. Every round each
session sends its whole history (its context, every earlier round's new tokens and replies) plus
``--chat-new`` new tokens and gets ``--chat-gen`` tokens back (greedy, ``ignore_eos``); all sessions
go in one ``generate`` call per round, ``--chat-rounds`` rounds. The engine child builds a
session's next prompt from token ids, its last prompt + the reply's token ids + the new tokens
(:mod:`kvtier.bench.engine_child`), so a connector that saved the reply can serve it in the next
round. With ``--hbm-tokens`` below the sessions' total the engine's own prefix cache cannot hold
them: what a round finds cached past that, the connector loaded.

Zero-hit: ``--zero-hit`` N prompts of ``--zero-hit-len`` tokens that share no prefix with anything
the engine saw, in one ``generate`` call of ``--chat-gen`` tokens each (greedy, ``ignore_eos``):
output tokens per second of that call, after the chat (a warm, full engine); ``--zero-hit-repeats``
such calls, each with prompts of its own, give the median. Through the ``LLM``
API (``zero_hit_via: "llm"``), not the OpenAI server: the engine bench's engines have dummy weights
and no tokenizer, and it has no served mode. With ``--profile``, 16 more such prompts run after it
under the profiler, not measured (tag ``zero-hit``).

Runs: ``--runs`` N runs every engine N times, each run in the reverse order of the one before
(:func:`run_order`): a busy round moves ±15-40 % between runs of one engine, so one run decides
nothing. ``chat_s`` is then each round's median over the runs, ``chat_runs_s`` every run's, and the
report gives each run's rounds 2+ and, run by run, kvtier's against vLLM's connector.

JSON (keys of the engine bench's result): ``chat_s`` {engine: [seconds per round]} (the median
over ``--runs``), ``chat_runs_s`` {engine: [[seconds per round] per run]},
``chat_cached_tokens`` {engine: [prompt tokens cached per round, summed over the sessions]},
``zero_hit_tok_s`` {engine: output tokens/s, the median of the calls}, ``zero_hit_runs_tok_s`` {engine:
[output tokens/s of each call]}, ``zero_hit_via``.
"""

from __future__ import annotations

import argparse
import json
import statistics

from kvtier.bench.common import parse_tokens, positive
from kvtier.config import ConfigError, KvtierConfig

ZERO_HIT_SEED = 2_000_000  # prompt seeds of their own: no prefix shared with the bench's other prompts
PROFILED_ZERO_HIT = 16  # prompts in the profiled zero-hit round (a trace of 64 is too large to read back)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The busy-engine flags of ``kvtier-bench engine``."""
    p.add_argument("--sessions", type=positive, default=32, help="chat sessions (default 32)")
    p.add_argument("--session-len", type=parse_tokens, default=6 << 10,
                   help="each session's unique context, tokens (default 6k)")
    p.add_argument("--chat-new", type=parse_tokens, default=200,
                   help="new tokens each session sends every round after its history (default 200)")
    p.add_argument("--chat-gen", type=positive, default=32,
                   help="tokens generated per session and round, and per zero-hit prompt (default 32)")
    p.add_argument("--chat-rounds", type=positive, default=4, help="chat rounds (default 4; rounds 2+ are timed)")
    p.add_argument("--zero-hit", type=int, default=0, metavar="N",
                   help="also run N concurrent unique prompts (nothing to hit or load) and report output tok/s "
                        "(default 0: off)")
    p.add_argument("--zero-hit-len", type=parse_tokens, default=4 << 10, help="zero-hit prompt length (default 4k)")
    p.add_argument("--zero-hit-repeats", type=positive, default=1,
                   help="zero-hit calls, each with new prompts; the median is reported (default 1)")
    p.add_argument("--runs", type=positive, default=1, metavar="N",
                   help="run the engines N times, each run in the reverse order of the one before; every row "
                        "takes all runs' samples, the chat its per-round medians (default 1)")
    p.add_argument("--kvtier-config", type=kvtier_settings, default={}, metavar="JSON",
                   help="more kvtier settings for the kvtier engine, as in kv_connector_extra_config, e.g. "
                        "'{\"save_replies\": false}' (cpu_bytes comes from --cpu-gib)")
    p.add_argument("--busy-only", action="store_true",
                   help="only the busy-engine rows: the chat and the zero-hit row (no TTFT, no prefill, no disk "
                        "engine); without CUDA, with --model, on a CPU vLLM")


def kvtier_settings(text: str) -> dict:
    """``--kvtier-config``: a JSON object of kvtier settings, checked as the connector checks them
    (an unknown key or a bad value is an error naming it)."""
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(settings, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    if "cpu_bytes" in settings:
        raise argparse.ArgumentTypeError("give the CPU tier's size with --cpu-gib, not cpu_bytes")
    try:
        KvtierConfig.from_dict(settings)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return settings


def run_order(engines: list[str], runs: int) -> list[str]:
    """The engines in the order they run over ``runs`` runs: as given, then reversed, and so on,
    each engine once a run (``a,b`` over 3 runs: ``a b b a a b``)."""
    names = list(dict.fromkeys(engines))
    return [name for run in range(runs) for name in (names if run % 2 == 0 else names[::-1])]


def longest_chat_tokens(args) -> int:
    """A session's last prompt plus its reply, tokens: what ``--hbm-tokens`` (the engine's
    ``max_model_len``) must hold."""
    return args.session_len + args.chat_rounds * (args.chat_new + args.chat_gen)


def check(parser: argparse.ArgumentParser, args) -> None:
    """Stop the command with one sentence where a busy-engine flag cannot work."""
    if args.zero_hit < 0:
        parser.error(f"argument --zero-hit: expected 0 (off) or a positive count, got {args.zero_hit}.")
    if not args.ttft_only and longest_chat_tokens(args) > args.hbm_tokens:
        parser.error(f"argument --hbm-tokens: {args.hbm_tokens} cannot hold a chat session's last round "
                     f"({longest_chat_tokens(args)} tokens with its reply).")
    if args.zero_hit and not args.ttft_only and args.zero_hit_len + args.chat_gen > args.hbm_tokens:
        parser.error(f"argument --hbm-tokens: {args.hbm_tokens} cannot hold a {args.zero_hit_len}-token zero-hit "
                     f"prompt and its {args.chat_gen} tokens.")


def busy_rounds(args, prompt) -> list[dict]:
    """The chat round (the engine child runs it as ``--chat-rounds`` ``generate`` calls), then the
    zero-hit round where ``--zero-hit`` asks for it. ``prompt(seed, length)``: token ids."""
    sessions = [prompt(500_000 + s, args.session_len) for s in range(args.sessions)]
    turns = [[prompt(600_000 + 1000 * t + s, args.chat_new) for s in range(args.sessions)]
             for t in range(args.chat_rounds)]
    rounds = [{"sessions": sessions, "turns": turns, "max_tokens": args.chat_gen, "reset": True, "tag": ["chat"]}]
    if getattr(args, "profile", None):  # and one more turn under the profiler
        rounds[0]["profile"] = "chat"
    if args.zero_hit:
        for call in range(getattr(args, "zero_hit_repeats", 1)):  # each call's prompts new to the engine
            seeds = range(ZERO_HIT_SEED + 100_000 * call, ZERO_HIT_SEED + 100_000 * call + args.zero_hit)
            rounds.append({"prompts": [prompt(s, args.zero_hit_len) for s in seeds], "max_tokens": args.chat_gen,
                           "tag": ["zero-hit"]})
        if getattr(args, "profile", None):  # and 16 more, not measured, under the profiler
            rounds.append({"prompts": [prompt(ZERO_HIT_SEED + 10_000 + i, args.zero_hit_len)
                                       for i in range(min(args.zero_hit, PROFILED_ZERO_HIT))],
                           "max_tokens": args.chat_gen, "tag": ["profiled"], "profile": "zero-hit"})
    return rounds


# kvtier's connector stats of where it made the engine wait (kvtier.engines.vllm.stats)
ENGINE_WAITS = ("engine_waits_save_reads", "engine_waits_save_backlog", "engine_wait_ms_save_backlog")


def collect(result: dict, name: str, rnd: dict, got, loaded_bytes) -> bool:
    """Take engine ``name``'s results of ``rnd`` from the iterator ``got`` into ``result`` if
    ``rnd`` is a chat or zero-hit round; whether it was. ``loaded_bytes(transfers)``: the KV bytes
    the connector loaded (:func:`kvtier.bench.engine_report.loaded_bytes`)."""
    tag = rnd["tag"][0]
    if tag == "chat":
        chat = [next(got) for _ in rnd["turns"]]
        runs = result.setdefault("chat_runs_s", {}).setdefault(name, [])
        runs.append([c["seconds"] for c in chat])
        result["chat_s"][name] = [statistics.median(r[i] for r in runs) for i in range(len(runs[0]))]
        result["chat_tokens"][name] = [[o["tokens"] for o in c["outputs"]] for c in chat]
        result.setdefault("chat_cached_tokens", {})[name] = [sum(o["cached"] for o in c["outputs"]) for c in chat]
        result["chat_reuse"][name] = [{"prompt": c.get("prompt_tokens"),
                                       "cached": sum(o["cached"] for o in c["outputs"]),
                                       "loaded_bytes": loaded_bytes(c.get("transfers")),
                                       "engine_waits": {k: (c.get("transfers") or {}).get(k, 0) for k in ENGINE_WAITS}}
                                      for c in chat]
        if (later := steps_of(chat[1:])) is not None:
            result.setdefault("chat_runs_steps", {}).setdefault(name, []).append(later)
        return True
    if tag == "zero-hit":
        one = next(got)
        runs = result.setdefault("zero_hit_runs_tok_s", {}).setdefault(name, [])
        runs.append(sum(len(o["tokens"]) for o in one["outputs"]) / one["seconds"])
        result.setdefault("zero_hit_tok_s", {})[name] = statistics.median(runs)
        result["zero_hit_via"] = "llm"
        return True
    return False


def steps_of(rounds: list[dict]) -> dict | None:
    """The engine steps of chat ``rounds`` together (each round's ``steps`` from
    :func:`kvtier.bench.engine_child.tap_steps`): ``{"steps", "running_mean", "preempted",
    "step_ms"}`` (ms a step, the rounds' seconds over their steps); None where a round has none."""
    if not rounds or any(not r.get("steps") for r in rounds):
        return None
    steps = sum(r["steps"]["steps"] for r in rounds)
    running = sum(r["steps"]["running_mean"] * r["steps"]["steps"] for r in rounds)
    return {"steps": steps, "running_mean": round(running / steps, 2),
            "preempted": sum(r["steps"]["preempted"] for r in rounds),
            "step_ms": round(1000 * sum(r["seconds"] for r in rounds) / steps, 1)}


def chat_run_lines(result: dict) -> list[str]:
    """With ``--runs`` > 1: each engine's rounds 2+ run by run, and kvtier's over vLLM's connector's
    in each run (the runs' engines ran side by side, in alternating order)."""
    runs = {k: [sum(r[1:]) for r in v] for k, v in (result.get("chat_runs_s") or {}).items()}
    if not runs or max(map(len, runs.values())) < 2:
        return []
    lines = ["multi-turn chat, rounds 2+ of each run (s): " + ", ".join(
        f"{k} [{', '.join(f'{s:.2f}' for s in v)}]" for k, v in runs.items())]
    if "kvtier" in runs and "offload" in runs and len(runs["kvtier"]) == len(runs["offload"]):
        ratios = [k / o for k, o in zip(runs["kvtier"], runs["offload"])]
        lines.append("kvtier / offload, run by run: " + ", ".join(f"{r:.2f}" for r in ratios)
                     + f" (median {statistics.median(ratios):.2f} x)")
    return lines


def step_lines(result: dict) -> list[str]:
    """Each engine's steps in the chat's rounds 2+, run by run: how many, requests running per
    step, preemptions and ms a step (a slower run takes more steps or longer ones)."""
    steps = result.get("chat_runs_steps") or {}
    if not steps:
        return []

    def one(s: dict) -> str:
        return f"{s['steps']}/{s['running_mean']:.1f}/{s['preempted']}/{s['step_ms']:.1f}"

    return ["engine steps, rounds 2+ of each run (steps / running per step / preempted / ms a step): " + ", ".join(
        f"{k} [{', '.join(map(one, v))}]" for k, v in steps.items())]


def report_lines(result: dict) -> list[str]:
    """The zero-hit row: each engine's output tokens/s, against no connector's where it ran."""
    tok_s = result.get("zero_hit_tok_s") or {}
    if not tok_s:
        return []
    args = result.get("args", {})
    base = tok_s.get("none")
    what = (f"{args['zero_hit']} unique prompts of {args['zero_hit_len']} tokens, {args['chat_gen']} generated each"
            if "zero_hit" in args else "unique prompts")
    runs = result.get("zero_hit_runs_tok_s") or {}
    calls = {k: " [" + ", ".join(f"{v:.0f}" for v in got) + "]" for k, got in runs.items() if len(got) > 1}
    median = " (median of each engine's calls)" if calls else ""
    return [f"zero-hit ({what}; {result.get('zero_hit_via', 'llm')} API), output tok/s{median}: " + ", ".join(
        f"{k} {v:.0f}{calls.get(k, '')}" + (f" ({v / base:.3f} x none)" if base and k != "none" else "")
        for k, v in tok_s.items())]
