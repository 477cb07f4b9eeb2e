"""``kvtier-bench engine --profile``: which rounds run under vLLM's profiler, and what a trace
summary says (made-up traces in the Chrome format vLLM's torch profiler writes; the engine
itself needs a CUDA vLLM), and the kvtier hook names a profile shows."""

from __future__ import annotations

import argparse
import gzip
import json

import torch

from kvtier.bench import engine, engine_busy, engine_profile


def _trace(path, step_ms: float, compile_ms: float = 0.0) -> str:
    """A worker rank's trace: the engine loop (thread 1) runs one step whose Python frame calls a
    kvtier hook and a CUDA op (and, in a first step, a compile of ``compile_ms``); thread 2, the
    chunk server, waits all along; one kernel ran on the GPU."""
    us = 1000.0
    events = [
        {"ph": "X", "cat": "python_function", "name": "vllm/worker.py(10): execute_model", "pid": 1, "tid": 1,
         "ts": 0, "dur": (step_ms + compile_ms) * us},
        {"ph": "X", "cat": "user_annotation", "name": "kvtier.start_load_kv", "pid": 1, "tid": 1, "ts": 10, "dur": 300},
        {"ph": "X", "cat": "python_function", "name": "site-packages/triton/compiler.py(5): compile", "pid": 1,
         "tid": 1, "ts": 400, "dur": compile_ms * us},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 400 + compile_ms * us, "dur": 2 * us},
        {"ph": "X", "cat": "python_function", "name": "kvtier/pd/producer/server.py(131): _serve", "pid": 1, "tid": 2,
         "ts": 0, "dur": 500 * us},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 500, "dur": 1.5 * us},
        {"ph": "i", "name": "an instant, not counted", "ts": 1},
    ]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_a_trace_summary_gives_the_loops_own_time_the_hooks_and_the_kernels(tmp_path):
    s = engine_profile.summarize_trace(_trace(tmp_path / "rank0.1.pt.trace.json.gz", step_ms=10, compile_ms=90))
    assert s["span_ms"] == 500.0 and s["gpu_busy_ms"] == 1.5
    assert s["kvtier"] == {"kvtier.start_load_kv": [0.3, 1]}
    python = {name: ms for name, ms, _ in s["python"]}
    assert python["triton/compiler.py(5): compile"] == 90.0  # the site-packages prefix dropped
    assert python["vllm/worker.py(10): execute_model"] == 100 - 90 - 2 - 0.3  # its own time, not its callees'
    assert not any("server.py" in name for name in python)  # another thread's frames: waits, left out
    assert ["gemm", 1.5, 1] in s["gpu"]


def test_a_trace_summary_since_a_moment_leaves_out_what_started_before(tmp_path):
    path = _trace(tmp_path / "rank0.json.gz", step_ms=10, compile_ms=90)  # the step: 0-100 ms, the server: 0-500
    seen = []
    late = engine_profile.summarize_trace(path, since=lambda events: seen.append(len(events)) or 499_000.0)
    assert late["span_ms"] == 0.0 and seen == [6]  # given every complete event; none starts after 499 ms
    tail = engine_profile.summarize_trace(path, since=lambda events: 300.0)  # from 0.3 ms on: the mm, the compile, the kernel
    assert {n for n, _, _ in tail["gpu"]} == {"gemm"} and tail["kvtier"] == {}
    assert "triton/compiler.py(5): compile" in {n for n, _, _ in tail["python"]}


def test_what_grew_from_a_later_round_to_the_first_is_listed_largest_first(tmp_path):
    first = engine_profile.summarize([_trace(tmp_path / "a.json.gz", step_ms=10, compile_ms=90)])
    later = engine_profile.summarize([_trace(tmp_path / "b.json.gz", step_ms=10)])
    profiles = {"kvtier": {"reload-first": first, "reload-later": later}}
    compared = engine_profile.comparisons(profiles)
    assert [c["what"] for c in compared] == ["kvtier's first reload against a later one"]  # the others: not profiled
    grew = compared[0]["ranks"][0]["grew"]
    assert grew[0] == ["python:triton/compiler.py(5): compile", 90.0, 0.0]
    lines = engine_profile.report_lines(compared)
    assert lines[1].startswith("  rank 0: span 500.0 / 500.0") and "kvtier.start_load_kv 0.3 (1)" in lines[1]
    assert "grew python:triton/compiler.py(5): compile: 90.0 / 0.0" in lines[2]
    assert "_all" not in json.dumps(engine_profile.public(first))


def test_profile_adds_rounds_of_its_own_and_leaves_the_measured_ones_as_they_were():
    args = argparse.Namespace(repeats=3, settle_s=0.0, profile="/tmp/p", ttft_only=False, prefill_batch=1,
                              prefill_len=16, sessions=1, session_len=16, chat_rounds=1, chat_new=8, chat_gen=4,
                              zero_hit=0, zero_hit_len=16, hbm_tokens=None)
    rounds = engine.engine_rounds(args, [64, 128], "kvtier")
    tags = [r.get("profile") for r in rounds]
    assert [t for t in tags if t] == ["local", "reload-first", "reload-later", "prefill", "chat"]
    local = tags.index("local")  # right after its prompt was computed: still in the engine's prefix cache
    assert rounds[local - 1]["tag"] == ["warmup"] and rounds[local - 1]["prompts"] == rounds[local]["prompts"]
    chat = rounds[tags.index("chat")]  # the chat's turns are measured; one more turn runs under the profiler
    assert chat["tag"] == ["chat"]
    assert all(r["tag"] == ["profiled"] for r in rounds if r.get("profile") and r is not chat)  # _collect counts none
    first = tags.index("reload-first")
    assert not any(r["tag"][0] in ("reload", "local") for r in rounds[:first])  # the first reload after start
    assert rounds[first]["prompts"][0] == rounds[first - 1]["prompts"][0] and len(rounds[first]["prompts"][0]) == 64
    args.profile = None
    measured = engine.engine_rounds(args, [64, 128], "kvtier")
    unprofiled = [{k: v for k, v in r.items() if k != "profile"} for r in rounds]
    assert [r for r in unprofiled if r["tag"] != ["profiled"] and r.get("prompts") != rounds[first]["prompts"]] == measured
    assert [r.get("profile") for r in engine.engine_rounds(args, [64, 128], "none")].count(None) == len(
        engine.engine_rounds(args, [64, 128], "none"))


def test_kvtiers_hooks_are_named_in_a_profile():
    from kvtier.engines.vllm.connector import KvtierConnector
    from kvtier.profiled import named

    def start_load_kv():
        return 7

    hook = named(start_load_kv)
    assert hook() == 7  # no profiler running: called as it is
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert hook() == 7
    assert "kvtier.start_load_kv" in {e.key for e in prof.key_averages()}
    assert KvtierConnector.start_load_kv.__wrapped__.__qualname__ == "KvtierConnector.start_load_kv"


def test_profile_adds_a_zero_hit_round_of_fresh_prompts_after_the_measured_one():
    args = argparse.Namespace(profile="/tmp/p", sessions=1, session_len=16, chat_rounds=1, chat_new=8, chat_gen=4,
                              zero_hit=64, zero_hit_len=32)
    rounds = engine_busy.busy_rounds(args, engine.prompt)
    measured, profiled = rounds[-2], rounds[-1]
    assert measured["tag"] == ["zero-hit"] and "profile" not in measured and len(measured["prompts"]) == 64
    assert profiled["tag"] == ["profiled"] and profiled["profile"] == "zero-hit"  # _collect counts none
    assert len(profiled["prompts"]) == engine_busy.PROFILED_ZERO_HIT and profiled["max_tokens"] == 4
    seen = {tuple(p) for r in rounds[:-1] for p in [*r.get("prompts", ()), *r.get("sessions", ())]}
    assert not seen & {tuple(p) for p in profiled["prompts"]}  # nothing to hit: prompts of their own
    args.profile = None
    assert [r["tag"] for r in engine_busy.busy_rounds(args, engine.prompt)] == [["chat"], ["zero-hit"]]
