"""``kvtier-bench engine``'s report from a made-up result (the bench itself needs a CUDA vLLM):
the table's ratios and target columns, the identical-output check, the plot."""

from __future__ import annotations

from kvtier.bench import engine
from kvtier.bench.cli import build_parser


def made_up(chat_b=None) -> dict:
    ttft = {"none": {"8192": {"recompute": [210.0], "local": [20.0]}},
            "kvtier": {"8192": {"recompute": [215.0], "local": [21.0], "reload": [40.0]}},
            "offload": {"8192": {"recompute": [215.0], "local": [21.0], "reload": [50.0]}},
            "disk": {"8192": {"disk": [300.0]}}}
    chat = [[1, 2], [3, 4]]
    return {"lengths": [8192], "repeats": 1, "ttft_ms": ttft, "h2d_gbps": 53.7, "kv_bytes_per_token": 128 << 10,
            "vllm": "0.26.0", "device": "H100", "start_s": {"none": 9.0, "kvtier": 15.0, "offload": 17.0},
            "prefill_tok_s": {"none": [1000.0], "kvtier": [990.0]}, "chat_s": {"none": [5, 3, 3], "kvtier": [5, 1, 1]},
            "checks": {"8192": {"none:check": [1, 2], "kvtier:check-reload": [1, 2]}},
            "chat_tokens": {"none": chat, "kvtier": chat_b or chat}}


def test_table_gives_the_ratios_against_vllm_and_the_floor():
    result = made_up()
    result["identical"] = engine._identical(result)
    table = engine.format_table(result)
    row = next(line for line in table.splitlines() if line.lstrip().startswith("8192"))
    target = 20 + 1.1 * 8192 * (128 << 10) / 53.7e9 * 1e3  # local + 1.1 x bytes / raw H2D
    assert f"{target:.0f}" in row.split()
    assert "0.80" in row.split()  # kvtier / vLLM: 40 / 50
    assert "(0.990 x none)" in table and "identical across engines (16-token checks, every chat reply): yes" in table


def test_a_differing_chat_reply_fails_the_identity_check():
    assert not engine._identical(made_up(chat_b=[[1, 2], [3, 5]]))


def test_plot_is_written(tmp_path):
    result = made_up()
    result["identical"] = True
    skipped = engine.write_plot(result, str(tmp_path / "engine.png"))
    assert skipped or (tmp_path / "engine.png").stat().st_size > 1000


def test_load_times_come_from_the_workers_debug_lines():
    log = ("(EngineCore pid=1) DEBUG kvtier: request 3 loaded 512 of 512 blocks (8192 tokens from cpu) in 21.5 ms\n"
           "DEBUG kvtier: request 4 loaded 96 of 100 blocks (1536 tokens from cpu) in 5.0 ms\n"
           "DEBUG kvtier: request 5 loaded 64 of 64 blocks (1024 tokens from disk) in 9.0 ms\n")
    assert engine.load_times(log) == {"8192": [21.5], "1536": [5.0]}


def test_the_first_reload_after_start_is_set_beside_the_later_ones():
    result = made_up()
    result["identical"] = True
    result["ttft_ms"]["kvtier"]["8192"]["reload"] = [1605.0, 74.0, 70.0]  # a first reload paying for a start-up cost
    line = next(ln for ln in engine.format_table(result).splitlines() if ln.startswith("first reload"))
    assert "kvtier 1605 at 8192 tokens (later 72, 22.29 x)" in line and "offload" not in line  # one reload: no line


def test_a_kvtier_reloads_stages_from_its_timeline_marks_are_printed():
    result = made_up()
    result["identical"] = True
    result["kvtier_stages_ms"] = {"arrived -> planned": 0.4, "load began -> load ended": 22.0}
    assert ("a kvtier reload's stages (median ms over the TTFT reloads, kvtier timeline): arrived -> planned 0.4, "
            "load began -> load ended 22.0") in engine.format_table(result)
    del result["kvtier_stages_ms"]
    assert "stages" not in engine.format_table(result)


def test_load_stages_take_the_requests_that_loaded_and_the_first_of_them_apart():
    def marks(req, *events):
        return [f"DEBUG kvtier timeline: {req} {event} {at:.6f}" for event, at in events]

    log = "\n".join([
        *marks("hit", ("arrived", 1.0), ("looked up", 1.001), ("finished", 1.030)),  # a local hit: no load
        *marks("first", ("arrived", 2.0), ("looked up", 2.002), ("planned", 2.003), ("load began", 2.004),
               ("load ended", 2.020), ("load reported", 2.021), ("load seen", 2.150), ("finished", 2.180)),
        *marks("later", ("arrived", 3.0), ("looked up", 3.002), ("planned", 3.003), ("load began", 3.004),
               ("load ended", 3.020), ("load reported", 3.021), ("load seen", 3.023), ("finished", 3.053)),
    ])
    every, first = engine.load_stages(log)
    assert first["load reported -> load seen"] == 129.0 and every["load reported -> load seen"] == 65.5
    assert "looked up -> finished" not in every  # the local hit is not a reload
    assert engine.load_stages("no marks") == ({}, {})
    only_first, _ = engine.load_stages(log, reloads=1)  # a later load (a chat round's, say) left out
    assert only_first["load reported -> load seen"] == 129.0


def test_the_ttft_reloads_are_the_single_prompt_rounds_after_a_reset():
    args = build_parser().parse_args(["engine", "--repeats", "2", "--prompt-lens", "8k,32k"])
    rounds = engine._ttft_rounds(args, [8192, 32768], 0, reload=True) + engine._workload_rounds(args)
    assert engine._reloads(rounds) == 2 * 2 + 2  # a reload per length and repeat, a checked one per length
    assert engine._reloads(engine._ttft_rounds(args, [8192], 0, reload=False)) == 0


def test_each_engines_local_hit_is_set_beside_no_connectors_with_its_spread():
    result = made_up()
    result["ttft_ms"]["kvtier"]["8192"]["local"] = [21.0, 30.0, 24.0]
    result["identical"] = engine._identical(result)
    line = next(ln for ln in engine.format_table(result).splitlines() if ln.startswith("local hit"))
    assert "8192 tokens: none 20 (20-20), kvtier 24 (21-30) +4, offload 21 (21-21) +1" in line
    del result["ttft_ms"]["none"]
    assert "local hit (" not in engine.format_table(result)  # nothing to set it beside


def test_local_repeats_gives_each_prompt_that_many_local_hits():
    args = build_parser().parse_args(["engine", "--local-repeats", "3", "--repeats", "2"])
    rounds = engine._ttft_rounds(args, [8192], 0, reload=True)
    assert sum(1 for r in rounds if r["tag"][0] == "local") == 3 * args.repeats
    assert sum(1 for r in rounds if r["tag"][0] == "reload") == args.repeats


def test_cuda_graphs_reach_every_engine_and_the_table_says_so(monkeypatch):
    import sys
    import types

    from kvtier.bench import engine_child

    args = build_parser().parse_args(["engine", "--cuda-graphs"])
    assert args.cuda_graphs and not build_parser().parse_args(["engine"]).cuda_graphs
    built = []
    vllm, config = types.ModuleType("vllm"), types.ModuleType("vllm.config")
    vllm.LLM, config.KVTransferConfig = (lambda **kw: built.append(kw)), (lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.config", config)
    spec = {"model": "/m", "connector": "none", "max_model_len": 1024}
    engine_child.build_engine(spec)
    engine_child.build_engine({**spec, "cuda_graphs": True})
    engine_child.build_engine({**spec, "scheduler": True})
    assert [kw["enforce_eager"] for kw in built] == [True, False, True]
    assert [kw.get("scheduler_cls") for kw in built] == [None, None, "kvtier.engines.vllm.scheduler.KvtierScheduler"]
    graphs = {**made_up(), "identical": True, "args": {"cuda_graphs": True}}
    assert "; CUDA graphs; TTFT ms" in engine.format_table(graphs)
    assert "; eager; TTFT ms" in engine.format_table({**made_up(), "identical": True})  # results before the flag


def test_chat_rounds_give_the_tokens_each_engine_computed_and_loaded():
    result = {"start_s": {}, "ttft_ms": {}, "checks": {}, "prefill_tok_s": {}, "chat_s": {}, "chat_tokens": {},
              "chat_reuse": {}, "reload_transfers": {}, "hybrid": {}}
    rounds = [{"tag": ["chat"], "turns": [[[1]], [[2]], [[3]]]}]
    chat = [{"seconds": 3.0, "transfers": {}, "prompt_tokens": 6000, "outputs": [{"tokens": [5], "cached": 0}]},
            {"seconds": 1.0, "transfers": {"loaded_bytes": 4000 * (128 << 10), "engine_waits_save_reads": 5,
                                           "engine_waits_save_backlog": 1, "engine_wait_ms_save_backlog": 20.4},
             "prompt_tokens": 6200,
             "outputs": [{"tokens": [5], "cached": 5900}]},
            {"seconds": 1.0, "transfers": {}, "prompt_tokens": 6400, "outputs": [{"tokens": [6], "cached": 6100}]}]
    engine._collect(result, "kvtier", rounds, {"start_s": 1.0, "rounds": chat})
    assert result["chat_reuse"]["kvtier"][1] == {
        "prompt": 6200, "cached": 5900, "loaded_bytes": 4000 * (128 << 10),
        "engine_waits": {"engine_waits_save_reads": 5, "engine_waits_save_backlog": 1, "engine_wait_ms_save_backlog": 20.4}}
    report = made_up()
    report["identical"] = True
    report["chat_reuse"] = result["chat_reuse"]
    report["kvtier_chat_stages_ms"] = {"loads": 12, "load began -> load ended": 9.5}
    table = engine.format_table(report)
    assert ("multi-turn chat, rounds 2+, prompt tokens computed (of all; loaded by the connector): "
            "kvtier 600 of 12600, 4000 loaded") in table
    assert "kvtier's loads in the chat (12; median ms, kvtier timeline): load began -> load ended 9.5" in table
    assert ("kvtier made the engine wait, rounds 2+: 5 steps for a save still reading their blocks, 1 saves for a "
            "full save backlog (20 ms)") in table


def test_chat_load_stages_leave_out_the_ttft_reloads():
    log = "\n".join(f"DEBUG kvtier timeline: {req} {event} {at:.6f}" for req, base in (("ttft", 1.0), ("chat", 2.0))
                    for event, at in (("arrived", base), ("load began", base + 0.001), ("load ended", base + 0.011),
                                      ("load seen", base + 0.02)))
    stages = engine.chat_load_stages(log, reloads=1)
    assert stages["loads"] == 1 and stages["load began -> load ended"] == 10.0
    assert engine.chat_load_stages(log, reloads=2) == {}


def test_kvtier_start_lines_include_its_cpu_tiers_pinning():
    log = ("INFO x [pinning.py:1] kvtier CPU tier: 40.0 GiB pinned in 9.2 s, 0% of it in transparent huge pages.\n"
           "INFO x [other.py:2] something else\n"
           "INFO x [worker_node.py:3] kvtier rank 0/1 on vLLM 0.33.0: 32 regions; started in 9.5 s (CPU tier 9.5 s)\n")
    assert [m[0] for m in engine._STARTED.finditer(log)] == [
        "kvtier CPU tier: 40.0 GiB pinned in 9.2 s, 0% of it in transparent huge pages.",
        "kvtier rank 0/1 on vLLM 0.33.0: 32 regions; started in 9.5 s (CPU tier 9.5 s)"]
