"""``kvtier-bench engine --family``: the Gemma-3-like preset's layers, the KV bytes a reload must
move (full attention against the window bound), the engines' specs and rounds, the connector
stats the engine child collects, and the bytes rows of the report. No GPU: made-up results."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from kvtier.bench import engine, engine_child, engine_report
from kvtier.bench.engine_model import (FULL, GEMMA3_LIKE, LLAMA3_8B, SLIDING, KvShape, gemma3_layer_types, kv_shape,
                                       read_kv_shape, write_model_dir)

GiB = 1 << 30
GEMMA_LAYER = 2 * 8 * 256 * 2  # K and V, 8 KV heads of 256, bf16: 8 KiB per token per layer


def test_gemma3_like_preset_is_a_text_gemma3_with_five_sliding_layers_to_one_global(tmp_path):
    types = GEMMA3_LIKE["layer_types"]
    assert GEMMA3_LIKE["architectures"] == ["Gemma3ForCausalLM"] and GEMMA3_LIKE["model_type"] == "gemma3_text"
    assert len(types) == GEMMA3_LIKE["num_hidden_layers"] == 48
    assert [i for i, t in enumerate(types) if t == FULL] == [5, 11, 17, 23, 29, 35, 41, 47]
    assert types.count(SLIDING) == 40 and GEMMA3_LIKE["sliding_window"] == 1024
    assert GEMMA3_LIKE["max_position_embeddings"] >= 40 << 10 and GEMMA3_LIKE["torch_dtype"] == "bfloat16"
    shape = read_kv_shape(write_model_dir("gemma3-like", str(tmp_path)))
    assert shape == KvShape(layer_bytes=GEMMA_LAYER, full_layers=8, sliding_layers=40, window=1024)


def test_gemma3_layer_types_follow_the_pattern_transformers_derives():
    assert gemma3_layer_types(6) == [SLIDING] * 5 + [FULL]
    assert gemma3_layer_types(8, every=4) == [SLIDING] * 3 + [FULL] + [SLIDING] * 3 + [FULL]


def test_full_attention_bytes_and_the_window_bound_at_32k():
    shape = kv_shape(GEMMA3_LIKE)
    assert shape.token_bytes == 48 * GEMMA_LAYER == 384 << 10
    assert shape.full_attention_bytes(32768) == 32768 * 48 * 8192 == 12 * GiB
    # 8 global layers keep all 32768 tokens, 40 sliding layers their last 1024: 2 GiB + 320 MiB
    assert shape.window_bound_bytes(32768) == 8192 * (32768 * 8 + 1024 * 40) == 2483027968
    assert shape.full_attention_bytes(32768) / shape.window_bound_bytes(32768) == pytest.approx(5.19, abs=0.01)


def test_the_window_bound_is_the_full_figure_below_the_window_and_for_llama():
    gemma = kv_shape(GEMMA3_LIKE)
    assert gemma.window_bound_bytes(512) == gemma.full_attention_bytes(512) == 512 * 48 * 8192
    llama = kv_shape(LLAMA3_8B)
    assert llama == KvShape(layer_bytes=2 * 8 * 128 * 2, full_layers=32)
    assert llama.window_bound_bytes(32768) == llama.full_attention_bytes(32768) == 4 * GiB


def test_kv_shape_reads_the_pattern_the_text_config_and_ignores_an_unused_window():
    pattern = {k: v for k, v in GEMMA3_LIKE.items() if k != "layer_types"}
    assert kv_shape(pattern) == kv_shape(GEMMA3_LIKE)
    assert kv_shape({"model_type": "gemma3", "text_config": GEMMA3_LIKE}) == kv_shape(GEMMA3_LIKE)
    qwen_like = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
                 "sliding_window": 4096}  # a window in the config, no layer using it
    assert kv_shape(qwen_like) == KvShape(layer_bytes=2 * 2 * 64 * 2, full_layers=4)


def _args(**over) -> argparse.Namespace:
    base = dict(hbm_tokens=64 << 10, cpu_gib=16, repeats=2, settle_s=1.0, ttft_only=False, prefill_len=1024,
                prefill_batch=2, sessions=2, session_len=1024, chat_rounds=2, chat_new=128, chat_gen=32, zero_hit=0,
                zero_hit_len=1024, busy_only=False, tp=1, cuda_graphs=False, kvtier_config={})
    return argparse.Namespace(**{**base, **over})


def test_a_windowed_model_gets_its_kv_cache_in_bytes_and_llama_in_blocks():
    assert engine._spec(_args(cuda_graphs=True), "/m", kv_shape(LLAMA3_8B), "kvtier", [])["cuda_graphs"] is True
    gemma = engine._spec(_args(), "/m", kv_shape(GEMMA3_LIKE), "offload", [], count_transfers=True)
    assert gemma["kv_cache_bytes"] == (65536 + 16) * (384 << 10) and "num_gpu_blocks" not in gemma  # + a block
    assert gemma["count_transfers"] and gemma["offload_gib"] == 16 and gemma["max_model_len"] == 65536
    llama = engine._spec(_args(), "/m", kv_shape(LLAMA3_8B), "kvtier", [])
    assert llama["num_gpu_blocks"] == 4096 + 1 and "kv_cache_bytes" not in llama and not llama["count_transfers"]


def test_at_tp2_every_rank_gets_the_cpu_tier_asked_for():
    kvtier = engine._spec(_args(tp=2), "/m", kv_shape(LLAMA3_8B), "kvtier", [])
    offload = engine._spec(_args(tp=2), "/m", kv_shape(LLAMA3_8B), "offload", [])
    assert kvtier["tp"] == offload["tp"] == 2
    assert kvtier["kvtier"]["cpu_bytes"] == 16 * GiB  # kvtier's cpu_bytes is each rank's
    assert offload["offload_gib"] == 32  # vLLM splits kv_offloading_size over its ranks


def test_ttft_only_leaves_out_prefill_and_chat():
    tags = lambda rounds: {r["tag"][0] for r in rounds}  # noqa: E731
    assert tags(engine.engine_rounds(_args(ttft_only=True), [32768], "kvtier")) == {
        "warmup", "recompute", "local", "reload", "check", "check-reload"}
    assert {"prefill", "chat"} <= tags(engine.engine_rounds(_args(), [32768], "kvtier"))
    assert "reload" not in tags(engine.engine_rounds(_args(ttft_only=True), [32768], "none"))


def test_loaded_bytes_from_each_connectors_reduced_stats():
    loaded = engine_report.loaded_bytes
    assert loaded({"loaded_bytes": 2483027968, "hit_tokens_cpu": 32768}) == 2483027968  # kvtier
    assert loaded({"vllm:kv_offload_load_bytes": 100, "vllm:kv_offload_store_bytes": 7}) == 100  # vLLM, newer
    assert loaded({"CPU_to_GPU_total_bytes": 300, "GPU_to_CPU_total_bytes": 9}) == 300  # vLLM, older
    assert loaded({"vllm:kv_offload_load_bytes:('cpu',)": 40, "vllm:kv_offload_load_bytes:('disk',)": 2}) == 42
    assert loaded({}) == 0  # reported nothing: moved nothing
    assert loaded(None) is None and loaded({"something_else": 1}) is None


def test_collect_keeps_each_reloads_stats_and_whether_the_hybrid_manager_stayed_on():
    result = {"start_s": {}, "ttft_ms": {}, "checks": {}, "prefill_tok_s": {}, "chat_s": {}, "chat_tokens": {},
              "reload_transfers": {}, "hybrid": {}}
    rounds = [{"tag": ["recompute", 32768]}, {"tag": ["reload", 32768]}]
    out = {"start_s": 30.0, "hybrid": True, "rounds": [
        {"seconds": 2.0, "transfers": {}, "outputs": [{"tokens": [5], "cached": 0}]},
        {"seconds": 0.1, "transfers": {"loaded_bytes": 7}, "outputs": [{"tokens": [5], "cached": 32768}]}]}
    engine._collect(result, "kvtier", rounds, out)
    assert result["reload_transfers"] == {"kvtier": {"32768": [{"loaded_bytes": 7}]}}
    assert result["hybrid"] == {"kvtier": True} and result["ttft_ms"]["kvtier"]["32768"]["reload"] == [100.0]


def made_up() -> dict:
    shape = kv_shape(GEMMA3_LIKE)
    n = "32768"
    return {"lengths": [32768], "repeats": 2, "vllm": "0.26.0", "device": "H100", "h2d_gbps": 50.0,
            "model": "gemma3-like", "kv_shape": {"layer_bytes": shape.layer_bytes, "full_layers": 8,
                                                 "sliding_layers": 40, "window": 1024},
            "kv_bytes_per_token": shape.token_bytes,
            "ttft_ms": {"none": {n: {"recompute": [2000.0, 2100.0], "local": [60.0, 60.0]}},
                        "kvtier": {n: {"reload": [120.0, 130.0]}}, "offload": {n: {"reload": [400.0, 420.0]}}},
            "reload_transfers": {"kvtier": {n: [{"loaded_bytes": 2500 << 20}, {"loaded_bytes": 2500 << 20}]},
                                 "offload": {n: [None, None]}},
            "hybrid": {"kvtier": True, "offload": True},
            "start_s": {"none": 50.0, "kvtier": 60.0, "offload": 55.0}, "prefill_tok_s": {}, "chat_s": {},
            "checks": {}, "chat_tokens": {}, "identical": True}


def test_table_gives_bytes_per_reload_beside_the_full_figure_and_the_window_bound():
    table = engine_report.format_table(made_up())
    assert "8 full-attention, 40 sliding-window (1024 tokens)" in table
    assert "window bound" in table and "full attn" in table
    row = next(line for line in table.splitlines() if line.split()[:3] == ["32768", "12288", "2368"])
    assert row.split()[3:] == ["2500", "1.06", "n/a", "-"]  # kvtier 2500 MiB = 1.06 x bound; vLLM's: no figure
    assert "vLLM's hybrid KV cache manager: kvtier on, offload on" in table
    assert "identical across engines (16-token checks): yes" in table
    # the reload floor is the window bound's copy: local 60 + 1.1 x 2368 MiB / 50 GB/s
    ttft_row = next(line for line in table.splitlines() if line.lstrip().startswith("32768"))
    assert f"{60 + 1.1 * 2483027968 / 50e9 * 1e3:.0f}" in ttft_row.split()


def test_plot_has_the_bytes_panel_with_and_without_the_chat(tmp_path):
    result = made_up()
    skipped = engine_report.write_plot(result, str(tmp_path / "a.png"))
    assert skipped or (tmp_path / "a.png").stat().st_size > 1000
    result["chat_s"] = {"none": [5.0, 3.0], "kvtier": [5.0, 1.0]}
    skipped = engine_report.write_plot(result, str(tmp_path / "b.png"))
    assert skipped or (tmp_path / "b.png").stat().st_size > 1000


class _Core:
    """An engine core client handing out made-up step outputs."""

    def __init__(self, outputs):
        self.outputs = list(outputs)

    def get_output(self):
        return self.outputs.pop(0)


def _step(stats: dict | None, tokens: int):
    return SimpleNamespace(outputs=[object()] * tokens,
                           scheduler_stats=SimpleNamespace(kv_connector_stats=stats))


def test_transfers_count_the_steps_that_produce_no_token(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtier.engines.vllm.connector import KvtierConnector

    monkeypatch.setattr(KVConnectorFactory, "get_connector_class", classmethod(lambda cls, config: KvtierConnector))
    core = _Core([_step({"loaded_bytes": 3 << 20, "hit_tokens_cpu": 256}, 0),  # the load finishes: no token
                  _step({"loaded_bytes": 1 << 20, "hit_tokens_cpu": 0}, 0), _step(None, 1)])
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="kvtier"),
                             scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config, engine_core=core))
    take = engine_child.tap_transfers(llm)
    assert take() == {}
    for _ in range(3):
        llm.llm_engine.engine_core.get_output()
    moved = take()
    assert engine_report.loaded_bytes(moved) == 4 << 20 and moved["hit_tokens_cpu"] == 256
    assert take() == {} and engine_child.hybrid_manager_on(llm) is True


def test_no_connector_no_transfers():
    config = SimpleNamespace(kv_transfer_config=None, scheduler_config=SimpleNamespace())
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config, engine_core=_Core([])))
    assert engine_child.tap_transfers(llm)() is None
    assert engine_child.hybrid_manager_on(llm) is None


def test_each_length_is_computed_and_hit_once_unmeasured_before_the_measured_rounds():
    """An engine's first short step over a long cached prefix was 100-150 ms at 8k: not a sample."""
    rounds = engine.engine_rounds(_args(ttft_only=True), [8192, 32768], "kvtier")
    first = next(i for i, r in enumerate(rounds) if r["tag"][0] != "warmup")
    warm = [len(r["prompts"][0]) for r in rounds[1:first]]
    assert warm == [8192, 8192, 32768, 32768] and rounds[1]["prompts"] == rounds[2]["prompts"]
    measured = {tuple(r["prompts"][0]) for r in rounds[first:] if r["tag"][0] != "warmup"}
    assert not measured & {tuple(r["prompts"][0]) for r in rounds[:first]}
