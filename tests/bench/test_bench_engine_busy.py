"""``kvtier-bench engine``'s busy-engine rows (:mod:`kvtier.bench.engine_busy`): the multi-turn chat
and the zero-hit row, their flags, rounds and report; end to end on a CPU vLLM with a tiny
dummy-weight Llama config (``--busy-only --model``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.bench import engine, engine_busy, engine_child, engine_model, engine_report
from kvtier.bench.cli import build_parser
from kvtier.bench.engine_model import LLAMA3_8B

ROOT = Path(__file__).resolve().parents[2]
GPU_COMMAND = ("engine --engines none,kvtier,offload --sessions 32 --session-len 6000 --chat-new 200 --chat-gen 32 "
               "--chat-rounds 4 --hbm-tokens 65536 --cpu-gib 40 --zero-hit 64 --zero-hit-len 4096")
# Round 1 sends 448 + 48 = 496 tokens a session and gets 32 back; kvtier's 256-token chunk ending at
# 512 holds reply tokens, so round 2 finds more than round 1's prompt only if the reply was saved.
# Two sessions (up to 608 tokens each) overflow a 640-token pool: what round 2 finds, kvtier loaded.
CI = ["engine", "--busy-only", "--engines", "kvtier", "--sessions", "2", "--session-len", "448", "--chat-new", "48",
      "--chat-gen", "32", "--chat-rounds", "2", "--hbm-tokens", "640", "--cpu-gib", "1", "--zero-hit", "2",
      "--zero-hit-len", "256"]


def test_the_gpu_command_parses_with_every_chat_and_zero_hit_flag():
    args = build_parser().parse_args(GPU_COMMAND.split())
    assert (args.sessions, args.session_len, args.chat_new, args.chat_gen, args.chat_rounds) == (32, 6000, 200, 32, 4)
    assert (args.hbm_tokens, args.zero_hit, args.zero_hit_len, args.busy_only) == (65536, 64, 4096, False)
    defaults = build_parser().parse_args(["engine"])
    assert (defaults.chat_new, defaults.chat_gen, defaults.zero_hit) == (200, 32, 0)


def test_chat_and_zero_hit_rounds_follow_the_flags():
    args = build_parser().parse_args(GPU_COMMAND.split())
    chat, zero = engine_busy.busy_rounds(args, engine.prompt)
    assert len(chat["sessions"]) == 32 and {len(s) for s in chat["sessions"]} == {6000}
    assert len(chat["turns"]) == 4 and {len(t) for turn in chat["turns"] for t in turn} == {200}
    assert chat["max_tokens"] == 32 and chat["reset"]
    assert len(zero["prompts"]) == 64 and {len(p) for p in zero["prompts"]} == {4096} and zero["max_tokens"] == 32
    firsts = {tuple(p[:16]) for p in zero["prompts"] + chat["sessions"]}  # no first block shared with anything
    assert len(firsts) == 64 + 32
    rounds = engine.engine_rounds(args, [8192], "kvtier")
    assert [r["tag"][0] for r in rounds[-2:]] == ["chat", "zero-hit"]
    busy = build_parser().parse_args([*GPU_COMMAND.split(), "--busy-only"])
    assert [r["tag"][0] for r in engine.engine_rounds(busy, [], "none")] == ["chat", "zero-hit"]
    off = build_parser().parse_args(["engine"])
    assert [r["tag"][0] for r in engine_busy.busy_rounds(off, engine.prompt)] == ["chat"]  # --zero-hit 0: off


def test_zero_hit_repeats_run_new_prompts_each_and_report_the_median():
    args = build_parser().parse_args([*GPU_COMMAND.split(), "--zero-hit-repeats", "3"])
    zeros = engine_busy.busy_rounds(args, engine.prompt)[1:]
    assert [r["tag"][0] for r in zeros] == ["zero-hit"] * 3
    assert len({tuple(p[:16]) for r in zeros for p in r["prompts"]}) == 3 * 64  # nothing shared across calls
    result: dict = {"chat_s": {}, "chat_tokens": {}, "chat_reuse": {}}
    runs = iter([{"seconds": s, "outputs": [{"tokens": [1] * 32}] * 64} for s in (8.0, 10.0, 9.0)])
    for rnd in zeros:
        assert engine_busy.collect(result, "kvtier", rnd, runs, None)
    assert result["zero_hit_runs_tok_s"]["kvtier"] == [256.0, 204.8, 2048 / 9]
    assert result["zero_hit_tok_s"]["kvtier"] == 2048 / 9  # the median call
    result["zero_hit_tok_s"]["none"], result["zero_hit_runs_tok_s"]["none"] = 250.0, [250.0, 240.0, 260.0]
    result["args"] = {"zero_hit": 64, "zero_hit_len": 4096, "chat_gen": 32}
    line = engine_busy.report_lines(result)[0]
    assert "(median of each engine's calls)" in line and "kvtier 228 [256, 205, 228] (0.910 x none)" in line


def test_a_pool_larger_than_the_model_keeps_max_model_len_within_its_positions(tmp_path):
    args = build_parser().parse_args(["engine", "--hbm-tokens", "300k"])
    model = engine.write_model_dir("llama3-8b", str(tmp_path))
    positions = engine.read_max_positions(model)
    spec = engine._spec(args, model, engine.read_kv_shape(model), "kvtier", [], positions=positions)
    assert spec["num_gpu_blocks"] == 300 * 1024 // 16 + 1 and spec["max_model_len"] == LLAMA3_8B["max_position_embeddings"]
    small = engine._spec(build_parser().parse_args(["engine"]), model, engine.read_kv_shape(model), "none", [],
                         positions=positions)
    assert small["max_model_len"] == 65536


def test_kvtier_settings_reach_the_kvtier_engine_checked_as_the_connector_checks_them(tmp_path, capsys):
    args = build_parser().parse_args(["engine", "--cpu-gib", "2", "--kvtier-config", '{"save_replies": false}'])
    model = engine.write_model_dir("llama3-8b", str(tmp_path))
    spec = engine._spec(args, model, engine.read_kv_shape(model), "kvtier", [])
    assert spec["kvtier"] == {"cpu_bytes": 2 << 30, "save_replies": False}
    assert engine._spec(build_parser().parse_args(["engine"]), model, engine.read_kv_shape(model), "kvtier",
                        [])["kvtier"] == {"cpu_bytes": 32 << 30}
    for bad, said in (('{"save_reply": false}', "unknown kvtier setting 'save_reply'"),
                      ('{"chunk_tokens": "x"}', "'chunk_tokens' must be an integer"), ("{", "not JSON"),
                      ("[1]", "not a JSON object"), ('{"cpu_bytes": 1}', "with --cpu-gib, not cpu_bytes")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["engine", "--kvtier-config", bad])
        assert said in capsys.readouterr().err


@pytest.mark.parametrize("extra, words", [
    (["--hbm-tokens", "6k"], "argument --hbm-tokens: 6144 cannot hold a chat session's last round"),
    (["--prompt-lens", "1k", "--zero-hit", "2", "--zero-hit-len", "64k"], "cannot hold a 65536-token zero-hit"),
    (["--busy-only", "--engines", "kvtier,disk"], "argument --engines: the disk engine has only TTFT rows"),
    (["--zero-hit", "-1"], "argument --zero-hit"),
])
def test_flags_that_cannot_work_stop_the_command_naming_the_flag(extra, words, capsys):
    args = build_parser().parse_args(["engine", "--prompt-lens", "1k", *extra])
    with pytest.raises(SystemExit) as exc:
        args.run(args.parser, args)
    assert exc.value.code == 2 and words in capsys.readouterr().err


def busy_result() -> dict:
    return {"lengths": [], "repeats": 3, "vllm": "0.33.0", "device": "H200", "h2d_gbps": None,
            "kv_bytes_per_token": 128 << 10, "ttft_ms": {}, "start_s": {"none": 9.0, "kvtier": 12.0},
            "prefill_tok_s": {}, "checks": {}, "chat_s": {"none": [5.0, 3.0], "kvtier": [5.0, 1.0]},
            "chat_tokens": {"none": [[1]], "kvtier": [[1]]},
            "chat_cached_tokens": {"none": [0, 100], "kvtier": [0, 900]},
            "zero_hit_tok_s": {"none": 2000.0, "kvtier": 1980.0}, "zero_hit_via": "llm", "identical": True,
            "args": {"zero_hit": 64, "zero_hit_len": 4096, "chat_gen": 32}}


def test_busy_only_table_has_the_chat_and_zero_hit_rows_and_no_ttft(tmp_path):
    table = engine_report.format_table(busy_result())
    assert "zero-hit (64 unique prompts of 4096 tokens, 32 generated each; llm API), output tok/s: none 2000, " \
           "kvtier 1980 (0.990 x none)" in table
    assert "multi-turn chat, rounds 2+ (s): none 3.00, kvtier 1.00" in table
    assert "recompute" not in table and "TTFT" not in table and "H2D" not in table
    skipped = engine_report.write_plot(busy_result(), str(tmp_path / "busy.png"))
    assert skipped or (tmp_path / "busy.png").stat().st_size > 1000


@pytest.mark.e2e
def test_busy_rows_on_a_cpu_vllm_reuse_the_replies_kvtier_saved(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    config = {**LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "torch_dtype": "float32",
              "max_position_embeddings": 4096}  # the preset's vocabulary: the bench's prompts draw from it
    (model / "config.json").write_text(json.dumps(config))
    out, png = tmp_path / "busy.json", tmp_path / "busy.png"
    run = subprocess.run([sys.executable, "-m", "kvtier.bench.cli", *CI, "--model", str(model), "--json", str(out),
                          "--plot", str(png)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "zero-hit (2 unique prompts of 256 tokens" in run.stdout
    data = json.loads(out.read_text())
    assert {k: data["args"][k] for k in ("sessions", "session_len", "chat_new", "chat_gen", "chat_rounds",
                                         "hbm_tokens")} == {"sessions": 2, "session_len": 448, "chat_new": 48,
                                                            "chat_gen": 32, "chat_rounds": 2, "hbm_tokens": 640}
    assert len(data["chat_s"]["kvtier"]) == 2 and all(s > 0 for s in data["chat_s"]["kvtier"])
    cached = data["chat_cached_tokens"]["kvtier"]
    first_prompt = 2 * (448 + 48)
    assert len(cached) == 2 and cached[1] > first_prompt, cached  # round 2 found round 1's replies too
    assert data["chat_reuse"]["kvtier"][1]["loaded_bytes"] > 0  # loaded from kvtier's tier, not the pool
    steps = data["chat_runs_steps"]["kvtier"][0]
    assert steps["steps"] >= 32 and steps["preempted"] >= 0, steps  # each reply's 32 tokens took a step each
    assert "engine steps, rounds 2+ of each run" in run.stdout
    assert data["zero_hit_via"] == "llm" and data["zero_hit_tok_s"]["kvtier"] > 0
    assert data["identical"] and data["h2d_gbps"] is None and data["lengths"] == []
    assert png.stat().st_size > 1000 or "matplotlib" in run.stderr


def test_a_model_directory_with_weights_is_loaded_with_them(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not engine_model.has_weights(str(tmp_path))  # config only: dummy weights
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert engine_model.has_weights(str(tmp_path))


def test_engines_run_in_the_order_given_each_once(tmp_path, monkeypatch):
    args = build_parser().parse_args(["engine", "--busy-only", "--engines", "offload,none,kvtier,offload",
                                      "--sessions", "1", "--session-len", "64", "--chat-rounds", "2"])
    started = []

    def spawn(spec, tmp, name, **kw):  # no engine: what the child would send back for the chat's turns
        started.append(name)
        turn = {"seconds": 1.0, "outputs": [{"tokens": [7], "cached": 0}]}
        return {"start_s": 0.5, "rounds": [turn, turn]}, ""

    monkeypatch.setattr(engine, "spawn", spawn)
    result = engine.run(args, [], ["offload", "none", "kvtier", "offload"], lambda message: None)
    assert started == ["offload", "none", "kvtier"]
    assert result["chat_s"] == {name: [1.0, 1.0] for name in started} and result["identical"]


def test_runs_alternate_the_order_and_report_medians_and_each_runs_ratio(tmp_path, monkeypatch):
    args = build_parser().parse_args(["engine", "--busy-only", "--engines", "offload,kvtier", "--runs", "3",
                                      "--sessions", "1", "--session-len", "64", "--chat-rounds", "3"])
    started = []
    seconds = {"offload": iter([2.0, 4.0, 3.0]), "kvtier": iter([1.0, 5.0, 3.3])}  # round 2's time, run by run

    def spawn(spec, tmp, name, **kw):  # no engine: the chat's turns as the child would send them back
        started.append(name)
        s = next(seconds[name])
        turns = [{"seconds": t, "outputs": [{"tokens": [7], "cached": 0}],
                  "steps": {"steps": 10, "running_mean": 2.0 if t == s else 4.0, "running_max": 4, "preempted": 1}}
                 for t in (9.0, s, 1.0)]
        return {"start_s": 0.5, "rounds": turns}, ""

    monkeypatch.setattr(engine, "spawn", spawn)
    result = engine.run(args, [], ["offload", "kvtier"], lambda message: None)
    assert started == ["offload", "kvtier", "kvtier", "offload", "offload", "kvtier"]
    assert result["chat_runs_s"]["kvtier"] == [[9.0, 1.0, 1.0], [9.0, 5.0, 1.0], [9.0, 3.3, 1.0]]
    assert result["chat_s"] == {"offload": [9.0, 3.0, 1.0], "kvtier": [9.0, 3.3, 1.0]}  # per-round medians
    lines = engine_busy.chat_run_lines(result)
    assert lines == ["multi-turn chat, rounds 2+ of each run (s): offload [3.00, 5.00, 4.00], kvtier [2.00, 6.00, 4.30]",
                     "kvtier / offload, run by run: 0.67, 1.20, 1.07 (median 1.07 x)"]
    table = engine.format_table(result)
    assert "multi-turn chat, rounds 2+ (s; per-round medians of 3 runs): offload 4.00, kvtier 4.30" in table
    assert lines[1] in table
    assert engine_busy.chat_run_lines({"chat_runs_s": {"kvtier": [[9.0, 1.0]]}}) == []  # one run: nothing more
    # rounds 2 and 3 of offload's first run: 20 steps, (10 x 2 + 10 x 4) / 20 running, 2 preempted, 3 s / 20
    # (kvtier's first run: both rounds took 1.0 s, the time given the 2 running)
    assert engine_busy.step_lines(result) == [
        "engine steps, rounds 2+ of each run (steps / running per step / preempted / ms a step): "
        "offload [20/3.0/2/150.0, 20/3.0/2/250.0, 20/3.0/2/200.0], kvtier [20/2.0/2/100.0, 20/3.0/2/300.0, 20/3.0/2/215.0]"]
    assert engine_busy.step_lines(result)[0] in table


def test_engine_steps_and_preemptions_are_counted_from_what_the_engine_core_sends():
    """A stand-in engine core (no engine runs here) sends vLLM's own output structs."""
    from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats

    def step(running, preempted=0):
        events = [EngineCoreEvent.new_event(EngineCoreEventType.PREEMPTED)] * preempted or None
        return EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="r", new_token_ids=[], events=events)],
                                 scheduler_stats=SchedulerStats(num_running_reqs=running))

    sent = iter([step(4), step(2, preempted=1), EngineCoreOutputs(), step(3)])
    core = SimpleNamespace(get_output=lambda: next(sent))
    take = engine_child.tap_steps(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core)))
    assert take() is None  # nothing yet
    for _ in range(3):
        core.get_output()
    assert take() == {"steps": 2, "running_mean": 3.0, "running_max": 4, "preempted": 1}
    core.get_output()
    assert take() == {"steps": 1, "running_mean": 3.0, "running_max": 3, "preempted": 0}
