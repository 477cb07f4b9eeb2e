"""End-to-end fixtures: a random-weight Llama-architecture model built offline (no download)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from e2e_engines import VOCAB  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A 2-layer Llama-architecture model with random weights (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> str:
    """The served tests' chat model (random weights, seed 0, with a tokenizer), built once."""
    from chat_model import build_chat_model

    return build_chat_model(tmp_path_factory.mktemp("chat-model") / "model")


@pytest.fixture(scope="session")
def pd_expected() -> dict:
    """A connector-less server's answers to every P/D prompt, by name: the first P/D module's
    fixture fills it (``test_pd.pd_servers``), and a later one then starts no such server."""
    return {}
