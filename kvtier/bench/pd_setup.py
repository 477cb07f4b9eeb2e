"""``kvtier-bench pd``'s set-up, from the model and the prompt lengths: the model's geometry (KV
bytes per token, vocabulary, parameters), the memory each server gets (:class:`Sizes`, tokens and
bytes) and the prompts (token ids that decode to printable ASCII on their own, the same for the
same arguments).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

MAX_LEN_SPARE = 64  # --max-model-len beyond the longest prompt (the streamed tokens fit), tokens
GiB, MiB = 1 << 30, 1 << 20


@dataclass(frozen=True)
class Geometry:
    """What the bench needs to know about the model: its KV size and vocabulary."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    params: int

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 K and V of every layer, bytes per token."""
        return self.layers * 2 * self.kv_heads * self.head_dim * 4


def read_geometry(model: str) -> Geometry:
    """Geometry from ``model``/config.json; the parameter count from the safetensors headers."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    text = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return Geometry(text["num_hidden_layers"], text.get("num_key_value_heads", heads), head_dim, text["hidden_size"],
                    text["vocab_size"], _count_params(Path(model)))


def _count_params(model: Path) -> int:
    total = 0
    for path in model.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for dim in entry["shape"]:
                    n *= dim
                total += n
    return total


@dataclass(frozen=True)
class Sizes:
    """Memory the servers get, from the model and the longest prompt (bytes, tokens)."""

    max_model_len: int  # longest prompt plus the streamed tokens, with room to spare, tokens
    kv_cache_bytes: int  # each engine's KV cache, bytes
    cpu_bytes: int  # each kvtier engine's CPU tier, bytes

    @classmethod
    def for_run(cls, geometry: Geometry, longest: int) -> Sizes:
        per_token = geometry.kv_bytes_per_token
        max_len = longest + MAX_LEN_SPARE
        # Four longest prompts: R keeps A for the local hit while B is prefilled, with headroom.
        kv = max(128 * MiB, _round_up(4 * per_token * max_len, 256 * MiB))
        # P pins every published prompt until D has it; ten longest prompts cover a run's backlog.
        cpu = max(256 * MiB, _round_up(10 * per_token * longest, 256 * MiB))
        return cls(max_len, kv, cpu)

    def host_bytes(self, geometry: Geometry) -> int:
        """Rough peak host memory of the three servers: weights, KV caches, two CPU tiers, and
        about 2 GiB of vLLM process overhead each."""
        return 3 * (geometry.params * 4 + self.kv_cache_bytes + 2 * GiB) + 2 * self.cpu_bytes


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def prompt_vocab(model: str, vocab: int) -> list[int]:
    """Token ids prompts are drawn from: those that decode to printable ASCII on their own (ids
    0-2, unk, bos and eos, left out). A lone byte of a multi-byte character would do as well for the
    engine, but vLLM's incremental detokenizer then spills the prompt's text into the first
    streamed token's; every id from 3 up when the tokenizer cannot be loaded."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
    except Exception:  # noqa: BLE001 - any failure: fall back to plain ids, the engine still takes them
        return list(range(3, vocab))
    ids = [i for i in range(3, min(vocab, len(tok))) if (t := tok.decode([i])) and t.isascii() and t.isprintable()]
    return ids or list(range(3, vocab))


def make_prompt(length: int, kind: str, repeat: int, ids: list[int]) -> list[int]:
    """``length`` ids drawn from ``ids``, the same for the same arguments."""
    rng = random.Random(f"kvtier-bench-pd/{length}/{kind}/{repeat}")
    return [rng.choice(ids) for _ in range(length)]

