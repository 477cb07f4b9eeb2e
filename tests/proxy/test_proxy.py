"""kvtier-proxy over real sockets, without vLLM.

``FakeEngine`` is a stand-in for an engine's OpenAI server, nothing more: a small FastAPI app
that speaks vLLM's two-leg protocol (a leg with ``do_remote_decode`` is a prefill leg and answers
``kv_transfer_params``; any other leg is a decode leg, streamed as SSE when asked). It records the
bodies it receives and whether a client went away, and can be told to fail, hold a leg open, or
break a stream. Engines and proxies run in-process under uvicorn, each on its own port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvtier.proxy import routing
from kvtier.proxy.app import create_app

WAIT_S = 5.0  # longest wait for something that should happen at once, s


class FakeEngine:
    """Stand-in for a vLLM OpenAI server (see the module docstring). All state is plain attributes."""

    def __init__(self, name: str):
        self.name = name
        self.app = FastAPI()
        self.reset()
        for path in ("/v1/completions", "/v1/chat/completions"):
            self.app.post(path)(self._generate)
        self.app.get("/health")(self._health)
        self.app.get("/v1/models")(self._models)

    def reset(self) -> None:
        self.bodies: list[dict] = []  # every POST body, in arrival order
        self.received_at: list[float] = []  # perf_counter of each arrival, s
        self.answered_at: list[float] = []  # perf_counter of each prefill answer, s
        self.kv_sent: list[dict] = []  # kv_transfer_params of each prefill answer
        self.fail: int | None = None  # answer every POST with this error status
        self.no_kv = False  # prefill answers without kv_transfer_params
        self.hold = False  # decode legs stay open until the client leaves
        self.break_after: int | None = None  # decode streams break after this many chunks
        self.push_delay_s = 0.0  # prefill legs with a transfer_id wait this long, s
        self.disconnects = 0  # legs whose client went away before the answer was complete
        self.healthy = True

    def kv_answer(self) -> dict:
        n = len(self.bodies)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"engine-{self.name}",
                "remote_block_ids": [n, n + 1], "remote_host": "10.0.0.7", "remote_port": 5600 + n,
                "remote_request_id": f"req-{self.name}-{n}", "tp_size": 1}

    async def _generate(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        self.received_at.append(time.perf_counter())
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode") and "transfer_id" in kv:
            await asyncio.sleep(self.push_delay_s)
        if self.fail:
            return JSONResponse(routing.error_body(f"{self.name} says no", "BadRequestError", self.fail),
                                status_code=self.fail)
        if kv.get("do_remote_decode"):  # prefill leg
            answer = completion(request.url.path, "P", prompt_tokens=7)
            if not self.no_kv:
                answer["kv_transfer_params"] = self.kv_answer()
                self.kv_sent.append(answer["kv_transfer_params"])
            self.answered_at.append(time.perf_counter())
            return answer
        if body.get("stream"):
            return StreamingResponse(self._stream(request.url.path, body), media_type="text/event-stream")
        if self.hold:
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
            self.disconnects += 1
            return JSONResponse({})
        return completion(request.url.path, f"{self.name} decoded", prompt_tokens=7)

    async def _stream(self, path: str, body: dict):
        done = False
        try:
            for i, chunk in enumerate(sse_chunks(path, body, self.name)):
                if self.break_after is not None and i == self.break_after:
                    raise RuntimeError("engine died mid-stream")  # uvicorn drops the connection
                yield chunk
                await asyncio.sleep(0.01)
                while self.hold:
                    await asyncio.sleep(0.02)
            done = True
        finally:
            if not done and self.break_after is None:
                self.disconnects += 1

    async def _health(self):
        return JSONResponse({}, status_code=200 if self.healthy else 503)

    async def _models(self):
        return {"object": "list", "data": [{"id": f"model-{self.name}", "object": "model"}]}


def completion(path: str, text: str, prompt_tokens: int) -> dict:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}
    if path.endswith("chat/completions"):
        return {"id": "chatcmpl-1", "object": "chat.completion", "usage": usage,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}]}
    return {"id": "cmpl-1", "object": "text_completion", "usage": usage,
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}


def sse_chunks(path: str, body: dict, name: str) -> list[bytes]:
    """A decode leg's SSE events as the fake engine sends them (one event per chunk)."""
    chat = path.endswith("chat/completions")
    events = []
    for i in range(4):
        choice = {"index": 0, "delta": {"content": f"{name}{i} "}} if chat else {"index": 0, "text": f"{name}{i} "}
        events.append({"id": "x", "choices": [choice]})
    if chat and (body.get("stream_options") or {}).get("include_usage"):
        events.append({"id": "x", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}})
    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


@contextlib.contextmanager
def serve(app):
    """Run ``app`` under uvicorn in a thread on a free port; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def dead_url() -> str:
    """A URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def engines():
    """Three fake engines, by name ("p", "d1", "d2") -> (engine, URL)."""
    fakes = {name: FakeEngine(name) for name in ("p", "d1", "d2")}
    with contextlib.ExitStack() as stack:
        yield {name: (fake, stack.enter_context(serve(fake.app))) for name, fake in fakes.items()}


@pytest.fixture(autouse=True)
def fresh(engines):
    for fake, _ in engines.values():
        fake.reset()


@pytest.fixture
def client():
    with httpx.Client(trust_env=False, timeout=WAIT_S * 2) as c:
        yield c


@contextlib.contextmanager
def proxy(prefill: list[str], decode: list[str], mode: str = "pull"):
    """A running kvtier-proxy; yields (URL, its Router)."""
    app = create_app(prefill, decode, mode, timeout_s=30)
    with serve(app) as url:
        yield url, app.state.router


@pytest.fixture
def pd(engines):
    """Proxy in pull mode over P and D1; yields (URL, P engine, D1 engine, router)."""
    (p, p_url), (d, d_url) = engines["p"], engines["d1"]
    with proxy([p_url], [d_url]) as (url, router):
        yield url, p, d, router


def idle(router) -> bool:
    return not any(router.prefill.outstanding.values()) and not any(router.decode.outstanding.values())


# ---- the two legs ------------------------------------------------------------------------------
def test_completion_legs_follow_the_protocol(pd, client):
    url, p, d, router = pd
    body = {"model": "m", "prompt": "hello", "max_tokens": 20, "min_tokens": 5, "temperature": 0,
            "stream_options": {"include_usage": True}, "kv_transfer_params": {"from": "client"}}
    resp = client.post(url + "/v1/completions", json=body)
    assert resp.status_code == 200
    assert resp.json() == completion("/v1/completions", "d1 decoded", prompt_tokens=7)

    [p_body] = p.bodies
    assert p_body == {"model": "m", "prompt": "hello", "temperature": 0, "max_tokens": 1, "stream": False,
                      "kv_transfer_params": routing.PULL_PREFILL_PARAMS}
    [d_body] = d.bodies
    assert d_body == {**body, "kv_transfer_params": p.kv_sent[0]}  # P's params unchanged, the rest the client's
    assert idle(router)


def test_chat_max_completion_tokens_becomes_one_token_on_prefill(pd, client):
    url, p, d, _ = pd
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
    assert client.post(url + "/v1/chat/completions", json=body).status_code == 200
    assert "max_completion_tokens" not in p.bodies[0] and p.bodies[0]["max_tokens"] == 1
    assert d.bodies[0]["max_completion_tokens"] == 9 and "max_tokens" not in d.bodies[0]
    assert d.bodies[0]["kv_transfer_params"]["remote_engine_id"] == "engine-p"


def test_missing_kv_params_still_decodes(pd, client, caplog):
    url, p, d, _ = pd
    p.no_kv = True
    with caplog.at_level("INFO", logger="kvtier.proxy"):
        resp = client.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"})
    assert resp.status_code == 200 and "kv_transfer_params" not in d.bodies[0]
    assert "sent no kv_transfer_params" in caplog.text
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]  # one line a request
    assert all(f in line for f in ("/v1/completions", "status=200", "mode=pull", "p_ms=", "d_ttfb_ms=", "tokens=7"))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_passes_through(pd, client, path):
    url, p, d, router = pd
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "prompt": "hi",
            "messages": [{"role": "user", "content": "hi"}]}
    with client.stream("POST", url + path, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        content = resp.read()
    assert content == b"".join(sse_chunks(path, body, "d1"))  # byte for byte, "choices": [] chunk included
    assert p.bodies[0]["stream"] is False and "stream_options" not in p.bodies[0]
    assert d.bodies[0]["stream"] is True and d.bodies[0]["stream_options"] == {"include_usage": True}
    wait_until(lambda: idle(router), "the stream's D leg to be released")


# ---- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_prefill_error_reaches_client(pd, client, stream):
    url, p, d, router = pd
    p.fail = 400
    resp = client.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": stream})
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": "p says no", "type": "BadRequestError", "code": 400}}
    assert d.bodies == []
    assert idle(router)


@pytest.mark.parametrize("stream", [False, True])
def test_decode_error_reaches_client(pd, client, stream):
    url, p, d, router = pd
    d.fail = 500
    resp = client.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": stream})
    assert resp.status_code == 500  # an error status, never a 200 with a truncated stream
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.json()["error"] == {"message": "d1 says no", "type": "BadRequestError", "code": 500}
    assert idle(router)


def test_broken_stream_ends_with_error_event(pd, client):
    url, p, d, router = pd
    d.break_after = 2
    with client.stream("POST", url + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}) as resp:
        assert resp.status_code == 200
        content = resp.read()
    events = [e for e in content.split(b"\n\n") if e]
    assert events[:2] == [c.strip() for c in sse_chunks("/v1/completions", {}, "d1")[:2]]
    last = json.loads(events[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == 502 and "stream broke" in last["error"]["message"]
    wait_until(lambda: idle(router), "the broken stream's D leg to be released")


def test_unreachable_decode_is_502_and_health_503(engines, client):
    (p, p_url), down = engines["p"], dead_url()
    with proxy([p_url], [down]) as (url, router):
        resp = client.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"})
        assert resp.status_code == 502 and down in resp.json()["error"]["message"]
        health = client.get(url + "/health")
        assert health.status_code == 503 and health.json()["down"] == [down]
        assert idle(router)


def test_health_and_models(engines, client):
    (p, p_url), (d, d_url) = engines["p"], engines["d1"]
    with proxy([p_url], [d_url]) as (url, _):
        assert client.get(url + "/health").json() == {"status": "ok"}
        assert client.get(url + "/v1/models").json()["data"][0]["id"] == "model-d1"
        p.healthy = False
        health = client.get(url + "/health")
        assert health.status_code == 503 and health.json()["down"] == [p_url]


def test_bad_json_is_400(pd, client):
    url, p, _, _ = pd
    resp = client.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == 400 and p.bodies == []


# ---- disconnects -------------------------------------------------------------------------------
def test_client_leaving_a_stream_cancels_decode(pd, client):
    url, p, d, router = pd
    d.hold = True  # D sends one chunk, then nothing until its client leaves
    with client.stream("POST", url + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}) as resp:
        chunks = resp.iter_raw()
        assert next(chunks).startswith(b"data: ")
        time.sleep(0.2)
        assert d.disconnects == 0 and list(router.decode.outstanding.values()) == [1]  # still streaming
    wait_until(lambda: d.disconnects == 1, "D to see its client (the proxy) leave")
    wait_until(lambda: idle(router), "the proxy to release D")


def test_client_leaving_a_request_cancels_decode(pd, client):
    url, p, d, router = pd
    d.hold = True
    with pytest.raises(httpx.ReadTimeout):
        client.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=0.5)
    wait_until(lambda: d.disconnects == 1, "D to see its client (the proxy) leave")
    wait_until(lambda: idle(router), "the proxy to release D")


# ---- routing -----------------------------------------------------------------------------------
def test_least_outstanding_decode(engines, client):
    (p, p_url), (d1, d1_url), (d2, d2_url) = engines["p"], engines["d1"], engines["d2"]
    body = {"model": "m", "prompt": "hi"}
    with proxy([p_url], [d1_url, d2_url]) as (url, router):
        assert client.post(url + "/v1/completions", json=body).json()["choices"][0]["text"] == "d1 decoded"  # tie
        d1.hold = True
        with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as held:
            chunks = held.iter_raw()  # kept: a dropped iterator closes the connection
            next(chunks)  # d1 now has one request in flight
            assert router.decode.outstanding == {d1_url: 1, d2_url: 0}
            assert client.post(url + "/v1/completions", json=body).json()["choices"][0]["text"] == "d2 decoded"
        wait_until(lambda: idle(router), "the held stream's release")
        d1.hold = False
        assert client.post(url + "/v1/completions", json=body).json()["choices"][0]["text"] == "d1 decoded"
    assert [len(d1.bodies), len(d2.bodies)] == [3, 1]


def test_pool_picks_fewest_then_first():
    pool = routing.Pool(["http://a/", "http://b", "http://c"])
    assert pool.urls == ["http://a", "http://b", "http://c"]
    assert [pool.acquire(), pool.acquire(), pool.acquire(), pool.acquire()] == \
        ["http://a", "http://b", "http://c", "http://a"]
    pool.release("http://b")
    assert pool.pick() == "http://b"


# ---- push mode ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_push_mode_sends_both_legs_at_once(engines, client, stream):
    (p, p_url), (d, d_url) = engines["p"], engines["d1"]
    body = {"model": "m", "prompt": "hi", "stream": stream}
    with proxy([p_url], [d_url], mode="push") as (url, router):
        first = client.post(url + "/v1/completions", json=body)  # no endpoint known yet: pull
        assert first.status_code == 200
        assert p.bodies[0]["kv_transfer_params"] == routing.PULL_PREFILL_PARAMS
        assert d.bodies[0]["kv_transfer_params"] == p.kv_sent[0]
        endpoint = {k: v for k, v in p.kv_sent[0].items() if k != "remote_request_id"}
        assert router.endpoints == {p_url: endpoint}

        p.push_delay_s = 0.3
        second = client.post(url + "/v1/completions", json=body)
        assert second.status_code == 200
        if stream:
            assert second.content == b"".join(sse_chunks("/v1/completions", body, "d1"))
        p_kv, d_kv = p.bodies[1]["kv_transfer_params"], d.bodies[1]["kv_transfer_params"]
        transfer_id = p_kv["transfer_id"]
        assert p_kv == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
        assert d_kv == {**endpoint, "remote_request_id": transfer_id, "transfer_id": transfer_id,
                        "do_remote_prefill": True, "do_remote_decode": False}
        assert p.bodies[1]["max_tokens"] == 1 and p.bodies[1]["stream"] is False
        assert d.received_at[1] < p.answered_at[1]  # D's leg went out while P was still computing
        assert router.endpoints[p_url] == routing.endpoint_fields(p.kv_sent[1])  # refreshed by P's 2nd answer
        assert router.endpoints[p_url] != endpoint
        wait_until(lambda: idle(router), "both legs' release")


def test_push_mode_prefill_failure_cancels_decode(engines, client):
    (p, p_url), (d, d_url) = engines["p"], engines["d1"]
    with proxy([p_url], [d_url], mode="push") as (url, router):
        assert client.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"}).status_code == 200
        p.fail, p.push_delay_s, d.hold = 500, 0.3, True
        resp = client.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"})
        assert resp.status_code == 500 and resp.json()["error"]["message"] == "p says no"
        assert "transfer_id" in d.bodies[1]["kv_transfer_params"]  # D's leg had been sent ...
        wait_until(lambda: d.disconnects == 1, "D's leg to be cancelled")  # ... and was cancelled
        wait_until(lambda: idle(router), "both legs' release")
