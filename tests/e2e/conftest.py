"""End-to-end fixtures: a random-weight Llama built offline, and engines run in their own processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).parent
VOCAB = 512


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


def run_engine(spec: dict, tmp_path: Path, name: str, env: dict | None = None) -> tuple[list, str]:
    """Run ``engine_run.py`` with ``spec``; returns (rounds, stderr+stdout log)."""
    spec_file = tmp_path / f"{name}.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_run.py"), str(spec_file)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine {name} failed:\n{log[-4000:]}"
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[7:])["rounds"], log


def prompt(seed: int, length: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]
