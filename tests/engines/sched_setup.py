"""Setting up kvtier's scheduler half in-process: vLLM configs, the store index, the lookup server.

Used by :mod:`sched_harness`; kept apart so the harness reads as the simulation it is.
"""

from __future__ import annotations

import atexit
import logging
import os
import tempfile
import uuid
from functools import lru_cache

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402

from kvtier.engines.vllm.plugin import register  # noqa: E402
from kvtier.keys import storage_key  # noqa: E402
from kvtier.lookup import LookupServer  # noqa: E402
from kvtier.lookup.protocol import VERSION, HoldReport  # noqa: E402

logging.getLogger("vllm").setLevel(logging.ERROR)

VOCAB = 512


@lru_cache(maxsize=1)
def model_dir() -> str:
    """A config-only Llama directory (the scheduler reads the config, never weights)."""
    from transformers import LlamaConfig

    path = tempfile.mkdtemp(prefix="kvtier-sched-model-")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=4096).save_pretrained(path)
    return path


class Index:
    """The stored chunks. Every change is mirrored into the real lookup server's hold index, as
    a single rank's hold report (the server thread reads it only while the test thread is
    blocked in a lookup)."""

    FINGERPRINT = b"kvtier-harness-0"

    def __init__(self, server: LookupServer | None = None) -> None:
        self.chunks: dict[bytes, tuple[str, tuple]] = {}  # chain key -> (tier, per-block shadow contents)
        self._server = server

    def put(self, key: bytes, tier: str, contents: tuple) -> None:
        self.chunks[key] = (tier, contents)
        self._report(key, tier)

    def remove(self, key: bytes) -> None:
        if self.chunks.pop(key, None) is not None:
            self._report(key, "")

    def _report(self, key: bytes, tier: str) -> None:
        if self._server is not None:
            report = HoldReport(VERSION, 0, 1, self.FINGERPRINT, [storage_key(key, self.FINGERPRINT)], [tier])
            assert self._server.index.apply(report) is None


@lru_cache(maxsize=1)
def lookup_server() -> tuple[str, LookupServer]:
    """One lookup server per process; each harness starts from an empty index."""
    register()
    endpoint = f"ipc://{tempfile.gettempdir()}/kvtier-harness-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    server = LookupServer(endpoint, 1)
    atexit.register(server.close)  # its socket file goes with the test session
    return endpoint, server


@lru_cache(maxsize=16)
def vllm_config(block_size: int, chunk_tokens: int, unaligned: str, min_load_tokens: int | None,
                max_num_seqs: int, max_batched: int, reserve_full: bool) -> VllmConfig:
    """A cached config per geometry and policy (building one costs ~0.3 s; schedulers share it)."""
    endpoint, _ = lookup_server()
    extra = {"chunk_tokens": chunk_tokens, "lookup_address": endpoint, "unaligned": unaligned, "cpu_bytes": 1 << 24}
    if min_load_tokens is not None:
        extra["min_load_tokens"] = min_load_tokens
    return VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False, scheduler_reserve_full_isl=reserve_full),
        model_config=ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="float32", max_model_len=2048),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector="kvtier", kv_role="kv_both",
                                            kv_load_failure_policy="recompute", kv_connector_extra_config=extra),
    )
