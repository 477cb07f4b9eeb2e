"""The model ``kvtier-bench engine`` runs: a preset's ``config.json`` (vLLM fills the weights with
``load_format="dummy"``; prompts are token ids, so no tokenizer), its KV cache geometry, and the
bytes a reload of a prompt moves.

Presets (``--family``):

* ``llama3-8b``: Llama-3-8B, every layer full attention (32 layers, 8 KV heads of 128);
* ``gemma3-like``: Gemma-3-12B's text model (``Gemma3ForCausalLM``, ``gemma3_text``): 48 layers,
  every sixth global (full attention) and the other five sliding-window layers of 1024 tokens,
  8 KV heads of 256. vLLM runs it with its hybrid KV cache manager: a sliding layer keeps only the
  blocks its window still reads.

Two reference figures per prompt, from the config alone (:class:`KvShape`): the full-attention
bytes, every layer's KV for every prompt token (what a reload moves for a model without sliding
layers, or with the hybrid manager off), and the window bound, the full-attention layers' KV for
every token plus the sliding layers' KV for the last ``sliding_window`` tokens (the least a
reload can move and still let the engine go on without recomputing).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

FAMILIES = ("llama3-8b", "gemma3-like")
KV_ELEMENT_BYTES = 2  # bf16 KV cache
FULL = "full_attention"
SLIDING = "sliding_attention"

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 65536,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16", "bos_token_id": 1,
             "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu"}

GEMMA3_EVERY = 6  # Gemma 3: five sliding-window layers, then one global


def gemma3_layer_types(num_layers: int, every: int = GEMMA3_EVERY) -> list[str]:
    """Gemma 3's layer pattern: layer ``i`` is global when ``(i + 1) % every == 0``, else sliding
    (transformers' ``sliding_window_pattern``, spelled out as ``layer_types``)."""
    return [FULL if (i + 1) % every == 0 else SLIDING for i in range(num_layers)]


GEMMA3_LIKE = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 3840,
               "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
               "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256, "vocab_size": 262208,
               "max_position_embeddings": 131072, "sliding_window": 1024, "sliding_window_pattern": GEMMA3_EVERY,
               "layer_types": gemma3_layer_types(48), "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
               "rms_norm_eps": 1e-06, "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
               "attn_logit_softcapping": None, "torch_dtype": "bfloat16", "pad_token_id": 0, "bos_token_id": 2,
               "eos_token_id": 1, "tie_word_embeddings": True}

PRESETS = {"llama3-8b": LLAMA3_8B, "gemma3-like": GEMMA3_LIKE}


def write_model_dir(family: str, parent: str) -> str:
    """Write ``parent/family/config.json`` for preset ``family``; returns the directory."""
    path = os.path.join(parent, family)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(PRESETS[family], f, indent=1)
    return path


@dataclass(frozen=True, slots=True)
class KvShape:
    """A model's KV cache per token. ``layer_bytes``: one token's K and V in one layer, bytes
    (``2 x num_key_value_heads x head_dim x 2``); ``full_layers`` / ``sliding_layers``: layers of
    full attention and of sliding-window attention; ``window``: the sliding window, tokens (0
    when there are no sliding layers)."""

    layer_bytes: int
    full_layers: int
    sliding_layers: int = 0
    window: int = 0

    @property
    def token_bytes(self) -> int:
        """Every layer's KV for one token, bytes."""
        return self.layer_bytes * (self.full_layers + self.sliding_layers)

    def full_attention_bytes(self, tokens: int) -> int:
        """Every layer's KV for ``tokens`` tokens, bytes: what a reload moves with no layer windowed."""
        return tokens * self.token_bytes

    def window_bound_bytes(self, tokens: int) -> int:
        """The full-attention layers' KV for ``tokens`` tokens plus the sliding layers' KV for the
        last ``min(tokens, window)``, bytes. Counted in tokens: a reload moves whole blocks, so a
        windowed layer's first block may start before the window and the figure is a little under
        the best a block-wise reload reaches."""
        return self.layer_bytes * (tokens * self.full_layers + min(tokens, self.window) * self.sliding_layers)

    def describe(self) -> str:
        """E.g. ``KV 384 KiB/token in all 48 layers; 8 full-attention, 40 sliding-window (1024 tokens)``."""
        layers = self.full_layers + self.sliding_layers
        text = f"KV {self.token_bytes >> 10} KiB/token in all {layers} layers"
        if self.sliding_layers:
            text += f"; {self.full_layers} full-attention, {self.sliding_layers} sliding-window ({self.window} tokens)"
        return text


def kv_shape(config: dict) -> KvShape:
    """The :class:`KvShape` of a Hugging Face text config (``config.json`` as a dict).

    Sliding layers come from ``layer_types`` (``sliding_attention``; any other type counts as full
    attention, so the bound errs high), else from Gemma's ``sliding_window_pattern``; without
    either, or without a ``sliding_window``, every layer is full attention. A multimodal config's
    ``text_config`` is the text model's.
    """
    config = config.get("text_config") or config
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    layer_bytes = 2 * config.get("num_key_value_heads", heads) * head_dim * KV_ELEMENT_BYTES  # K and V
    window = config.get("sliding_window") or 0
    types = config.get("layer_types")
    if types is None and config.get("sliding_window_pattern"):
        types = gemma3_layer_types(layers, config["sliding_window_pattern"])
    sliding = sum(t == SLIDING for t in types) if window and types else 0
    return KvShape(layer_bytes, layers - sliding, sliding, window if sliding else 0)


def read_kv_shape(model_dir: str) -> KvShape:
    """:func:`kv_shape` of ``model_dir/config.json``."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return kv_shape(json.load(f))


def has_weights(model_dir: str) -> bool:
    """Whether ``model_dir`` holds weights (``*.safetensors`` or ``*.bin``): the engine loads them
    instead of dummy ones, so its greedy answers depend on their context."""
    return os.path.isdir(model_dir) and any(name.endswith((".safetensors", ".bin")) for name in os.listdir(model_dir))


def read_max_positions(model_dir: str) -> int | None:
    """``max_position_embeddings`` of ``model_dir/config.json`` (its text model's), tokens; None
    where it has none."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return (config.get("text_config") or config).get("max_position_embeddings")
