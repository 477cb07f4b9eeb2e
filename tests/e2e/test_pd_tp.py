"""P/D with tensor parallelism on both sides: two real vLLM engines with ``tensor_parallel_size=2``
(four worker processes; vLLM binds rank 0 of each engine to core 0 and rank 1 to core 1), each
D rank fetching its shard from the same P rank. The decode engine's answer must equal its own
recompute of the prompt (another ``cache_salt``), and it must have loaded the whole prompt with no
rank recomputing.

The engines start in their own process groups of this session (``start_group``). Started in
sessions of their own, this test failed every time: the kernel's autogroup schedules each
session as one group, and on each core D's rank, busy-waiting for the KV, left P's rank no CPU
for seconds, so P's chunk server answered nothing within ``pd_timeout_ms``.
"""

from __future__ import annotations

import pytest

from e2e_engines import StandingEngine, prompt

pytestmark = pytest.mark.e2e

CHUNK = 64
PROMPT = prompt(21, 5 * CHUNK + 30)


def test_tp2_producer_to_tp2_consumer_is_token_identical(tiny_llama, tmp_path):
    kvtier = {"chunk_tokens": CHUNK, "cpu_bytes": 64 << 20, "pd_timeout_ms": 5000}
    engines = []
    try:
        p = StandingEngine({"model": tiny_llama, "tp": 2, "kvtier": kvtier}, tmp_path, "p")
        engines.append(p)
        d = StandingEngine({"model": tiny_llama, "tp": 2, "kvtier": kvtier, "role": "kv_consumer"}, tmp_path, "d")
        engines.append(d)
        for engine in engines:
            engine.ready()
        published = p.ask(PROMPT, 1, {"do_remote_decode": True})["params"]
        assert published["tp_size"] == 2 and len(published["kvtier_endpoints"]) == 2
        published.pop("remote_prefill_cached_tokens", None)  # else vLLM reports P's count as D's
        out = d.ask(PROMPT, 12, published)
        recomputed = d.ask(PROMPT, 12, salt="recompute")  # the same tokens, no hit: D computes them all
        assert recomputed["cached"] == 0 and out["tokens"] == recomputed["tokens"]
        assert out["cached"] >= len(PROMPT) - 1, "".join(d.printed)  # both ranks loaded their shards of the whole prompt
        assert "recomputing" not in "".join(d.printed)
    finally:
        for engine in engines:
            engine.stop()
