"""One leg of a proxied request: a call to one prefill (P) or decode (D) server, and its answer, or
its failure, as the client must see it.

Every leg records its timings in the request's :class:`Exchange`, which logs one line per client
request. An error status or a lost connection becomes a :class:`LegError` carrying the status and
an OpenAI-style body for the client. Which servers run the legs, and in which order, is
:mod:`kvtier.proxy.app`'s.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable

import httpx
from fastapi.responses import Response, StreamingResponse

from kvtier.proxy import routing

log = logging.getLogger("kvtier.proxy")

CLIENT_GONE = 499  # status logged (nobody reads it) for a request whose client disconnected


class LegError(Exception):
    """A leg failed in a way the client must see: HTTP ``status`` with JSON ``body``."""

    def __init__(self, status: int, body: dict):
        super().__init__(status, body)
        self.status, self.body = status, body


def unreachable(role: str, url: str, err: httpx.HTTPError) -> LegError:
    """502 (504 on a timeout) naming the server that could not be reached."""
    status = 504 if isinstance(err, httpx.TimeoutException) else 502
    message = f"{role} server {url} unreachable: {type(err).__name__}: {err}"
    return LegError(status, routing.error_body(message, "upstream_unreachable", status))


@dataclass
class Exchange:
    """One client request: where its legs went and how long they took (for the log line)."""

    endpoint: str
    request_id: str
    p_url: str
    d_url: str
    mode: str
    status: int = 0
    p_ms: float | None = None  # P's leg, request to complete answer, ms
    d_start: float = 0.0  # perf_counter when D's leg was sent, s
    d_ttfb_ms: float | None = None  # D's leg, request to first body byte, ms
    tokens: int | None = None  # prompt tokens P computed (and so transferred), from P's usage

    def first_byte(self) -> None:
        if self.d_ttfb_ms is None:
            self.d_ttfb_ms = (time.perf_counter() - self.d_start) * 1e3

    def log(self) -> None:
        ms = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        log.info("%s id=%s status=%d P=%s D=%s mode=%s p_ms=%s d_ttfb_ms=%s tokens=%s", self.endpoint,
                 self.request_id, self.status, self.p_url, self.d_url, self.mode, ms(self.p_ms), ms(self.d_ttfb_ms),
                 "-" if self.tokens is None else self.tokens)


class Relay(StreamingResponse):
    """A StreamingResponse that runs ``on_close`` however streaming ends (done, client gone, error).

    Starlette cancels a stream whose client left, but a generator cancelled between chunks is only
    closed when garbage-collected; closing D's stream here, at once, is what makes D abort.
    """

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.on_close()


async def prefill_leg(client: httpx.AsyncClient, ex: Exchange, body: dict, headers: dict) -> dict:
    """Run P's leg; P's JSON answer. Raises LegError on an error status or no connection."""
    start = time.perf_counter()
    try:
        resp = await client.post(ex.p_url + ex.endpoint, json=body, headers=headers)
    except httpx.HTTPError as err:
        raise unreachable("prefill", ex.p_url, err) from err
    finally:
        ex.p_ms = (time.perf_counter() - start) * 1e3
    if resp.status_code >= 400:
        log.warning("prefill server %s answered %d: %s", ex.p_url, resp.status_code, resp.text[:500])
        raise LegError(resp.status_code, routing.upstream_error(resp.status_code, resp.content))
    try:
        answer = resp.json()
    except ValueError as err:
        raise LegError(502, routing.error_body(f"prefill server {ex.p_url} answered non-JSON",
                                               "upstream_error", 502)) from err
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        ex.tokens = usage["prompt_tokens"]
    return answer if isinstance(answer, dict) else {}


async def open_decode(client: httpx.AsyncClient, ex: Exchange, body: dict, headers: dict) -> httpx.Response:
    """Send D's leg; D's answer once its headers are in, body unread (the caller closes it).
    Raises LegError on an error status (so a stream never starts as a truncated 200)."""
    ex.d_start = time.perf_counter()
    request = client.build_request("POST", ex.d_url + ex.endpoint, json=body, headers=headers)
    try:
        resp = await client.send(request, stream=True)
    except httpx.HTTPError as err:
        raise unreachable("decode", ex.d_url, err) from err
    if resp.status_code < 400:
        return resp
    try:
        content = await resp.aread()
    except httpx.HTTPError:
        content = b""
    finally:
        await resp.aclose()
    ex.first_byte()
    log.warning("decode server %s answered %d: %s", ex.d_url, resp.status_code,
                content[:500].decode("utf-8", "replace"))
    raise LegError(resp.status_code, routing.upstream_error(resp.status_code, content))


async def decode_leg(client: httpx.AsyncClient, ex: Exchange, body: dict, headers: dict) -> Response:
    """D's leg, not streamed: D's JSON answer with D's status."""
    resp = await open_decode(client, ex, body, headers)
    chunks = []
    try:
        async for chunk in resp.aiter_bytes():
            ex.first_byte()
            chunks.append(chunk)
    except httpx.HTTPError as err:
        raise unreachable("decode", ex.d_url, err) from err
    finally:
        await resp.aclose()
    media = resp.headers.get("content-type", "application/json")
    return Response(b"".join(chunks), status_code=resp.status_code, media_type=media)


def relay(ex: Exchange, resp: httpx.Response, release: Callable[[], None]) -> Relay:
    """D's open stream as the client's response; D's SSE bytes pass through unparsed. When the
    stream ends, however it ends, ``release`` frees D's slot, then the request's line is logged."""
    finished = False  # D's stream ended (or broke); not yet when the client left first

    async def body():
        nonlocal finished
        tail = b"\n\n"
        try:
            async for chunk in resp.aiter_bytes():
                ex.first_byte()
                tail = (tail + chunk)[-2:]
                yield chunk
            finished = True
        except httpx.HTTPError as err:
            finished = True
            log.warning("decode server %s stream broke: %s: %s", ex.d_url, type(err).__name__, err)
            ex.status = 502
            error = routing.error_body(f"decode server {ex.d_url} stream broke: {type(err).__name__}: {err}",
                                       "upstream_error", 502)
            # End any half-sent event first, so the error arrives as an event of its own.
            yield (b"" if tail == b"\n\n" else b"\n\n") + b"data: " + json.dumps(error).encode() + b"\n\n"

    closed = False

    async def on_close():
        nonlocal closed
        if closed:
            return
        closed = True
        if not finished:
            ex.status = CLIENT_GONE
        release()
        ex.log()
        await resp.aclose()

    ex.status = resp.status_code
    return Relay(body(), on_close, status_code=resp.status_code, media_type="text/event-stream")
