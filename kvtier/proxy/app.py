"""``kvtier-proxy``: an OpenAI-compatible router that splits each request into a prefill and a decode leg.

vLLM's two-leg protocol (``--mode pull``, the default): the client's body goes to a prefill server
(P) with ``max_tokens=1`` and ``kv_transfer_params.do_remote_decode``; P computes the prompt's KV,
keeps it, and answers with ``kv_transfer_params`` saying where it is. The client's body then goes
to a decode server (D) with those params; D fetches the KV instead of recomputing it, and its answer
(streamed or not) is the client's.

``--mode push``: P pushes the KV to D as it is computed, so both legs run at once. D must know
P's transfer endpoint up front; the proxy learns it from P's earlier answers (each P URL's last
kv_transfer_params), and falls back to the pull flow for a P it has not heard from yet.

Several ``--prefill`` / ``--decode`` URLs are balanced by fewest requests in flight. An error on
either leg reaches the client with that leg's status; a client that leaves cancels the legs in
flight, which closes their connections so the engines abort the requests.

This module routes; each leg's call to its server is :mod:`kvtier.proxy.legs`. The proxy is the
only part of kvtier that uses fastapi, httpx and uvicorn; it imports nothing from vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvtier.proxy import routing
from kvtier.proxy.legs import CLIENT_GONE, Exchange, LegError, decode_leg, open_decode, prefill_leg, relay, unreachable

log = logging.getLogger("kvtier.proxy")

MODES = ("pull", "push")
POLL_S = 0.1  # how often a waiting non-streamed request checks that its client is still there, s
HEALTH_TIMEOUT_S = 5.0  # one server's /health answer, s
FORWARDED_HEADERS = ("authorization",)


class ClientGone(Exception):
    """The client disconnected while legs were in flight (they have been cancelled)."""


async def _discard(tasks) -> None:
    """Cancel ``tasks`` still running; close any upstream response one of them already opened."""
    for task in tasks:
        task.cancel()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, httpx.Response):
            await result.aclose()


async def _until_any(request: Request, tasks: set) -> None:
    """Return once any of ``tasks`` is done; raise ClientGone if the client disconnects first."""
    while not (await asyncio.wait(tasks, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED))[0]:
        if await request.is_disconnected():
            raise ClientGone()


class Router:
    """The proxy's state: server pools, the shared HTTP client, push mode's endpoint cache."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], mode: str, timeout_s: float):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.prefill, self.decode = routing.Pool(prefill_urls), routing.Pool(decode_urls)
        self.mode, self.timeout_s = mode, timeout_s
        self.endpoints: dict[str, dict] = {}  # push mode: P URL -> its transfer endpoint's fields
        self.client: httpx.AsyncClient | None = None  # set by the app's lifespan

    @contextlib.asynccontextmanager
    async def lifespan(self, _app):
        # No pool limit: every in-flight stream holds a connection, and a cap would queue legs.
        # trust_env=False: engines are reached directly, never through an HTTP(S)_PROXY.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s), limits=limits,
                                     trust_env=False) as client:
            self.client = client
            yield
        self.client = None

    # ---- one client request ----------------------------------------------------------------------
    async def handle(self, request: Request, endpoint: str) -> Response:
        """Route one completions / chat completions request through a P and a D server."""
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse(routing.error_body("request body must be a JSON object", "invalid_request_error",
                                                   400), status_code=400)
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        # One fresh id for both legs (vLLM takes it as its request id): a client's own could repeat.
        headers["x-request-id"] = uuid.uuid4().hex

        p_url, d_url = self.prefill.acquire(), self.decode.acquire()
        endpoint_fields = self.endpoints.get(p_url) if self.mode == "push" else None
        ex = Exchange(endpoint, headers["x-request-id"], p_url, d_url,
                      "push" if endpoint_fields is not None else "pull")
        stream = bool(body.get("stream"))
        tasks: list[asyncio.Task] = []  # legs in flight, cancelled (their responses closed) on exit
        streaming = False
        try:
            if endpoint_fields is None:
                d_task = await self._pull(request, ex, body, headers, stream, tasks)
            else:
                d_task = await self._push(request, ex, body, headers, stream, endpoint_fields, tasks)
            if not d_task.done():
                await _until_any(request, {d_task})
            result = d_task.result()
            tasks.remove(d_task)
            if stream:
                streaming = True  # from here the Relay releases D and logs
                return relay(ex, result, lambda: self.decode.release(ex.d_url))
            ex.status = result.status_code
            return result
        except LegError as err:
            ex.status = err.status
            return JSONResponse(err.body, status_code=err.status)
        except ClientGone:
            ex.status = CLIENT_GONE
            return Response(status_code=CLIENT_GONE)
        finally:
            await _discard(tasks)
            if not streaming:
                self.decode.release(d_url)
                ex.log()

    def _start_prefill(self, ex: Exchange, body: dict, headers: dict, tasks: list) -> asyncio.Task:
        task = asyncio.ensure_future(prefill_leg(self.client, ex, body, headers))
        task.add_done_callback(lambda _: self.prefill.release(ex.p_url))  # runs even if cancelled unstarted
        tasks.append(task)
        return task

    def _start_decode(self, ex: Exchange, body: dict, headers: dict, stream: bool, tasks: list) -> asyncio.Task:
        leg = open_decode if stream else decode_leg
        task = asyncio.ensure_future(leg(self.client, ex, body, headers))
        tasks.append(task)
        return task

    def _learn(self, ex: Exchange, kv_params) -> None:
        """Push mode: remember P's transfer endpoint from its answer, for the next requests."""
        if self.mode == "push" and isinstance(kv_params, dict):
            self.endpoints[ex.p_url] = routing.endpoint_fields(kv_params)

    async def _pull(self, request, ex, body, headers, stream, tasks) -> asyncio.Task:
        """P's leg, then D's with P's kv_transfer_params; returns D's task (started)."""
        p_task = self._start_prefill(ex, routing.prefill_body(body, routing.PULL_PREFILL_PARAMS), headers, tasks)
        await _until_any(request, {p_task})
        kv_params = p_task.result().get("kv_transfer_params")
        tasks.remove(p_task)
        if kv_params is None:
            log.warning("prefill server %s sent no kv_transfer_params: decode server %s recomputes the prompt",
                        ex.p_url, ex.d_url)
        self._learn(ex, kv_params)
        return self._start_decode(ex, routing.decode_body(body, kv_params), headers, stream, tasks)

    async def _push(self, request, ex, body, headers, stream, endpoint_fields, tasks) -> asyncio.Task:
        """Both legs at once, tied by a fresh transfer id; returns D's task once P's leg is done.
        P failing cancels D (the caller discards it); D failing first cancels P."""
        transfer_id = uuid.uuid4().hex
        p_body = routing.prefill_body(body, routing.push_prefill_params(transfer_id))
        d_body = routing.decode_body(body, routing.push_decode_params(endpoint_fields, transfer_id))
        p_task = self._start_prefill(ex, p_body, headers, tasks)
        d_task = self._start_decode(ex, d_body, headers, stream, tasks)
        while not p_task.done():
            await _until_any(request, {p_task} if d_task.done() else {p_task, d_task})
            if d_task.done() and not p_task.done() and d_task.exception() is not None:
                raise d_task.exception()
        self._learn(ex, p_task.result().get("kv_transfer_params"))  # raises P's LegError
        tasks.remove(p_task)
        return d_task

    # ---- other endpoints -------------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        """200 only if every P and D server's /health answers 200; else 503 naming the others."""
        urls = list(dict.fromkeys(self.prefill.urls + self.decode.urls))
        up = await asyncio.gather(*(self._up(url) for url in urls))
        down = [url for url, ok in zip(urls, up) if not ok]
        if down:
            return JSONResponse({"status": "unavailable", "down": down}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def _up(self, url: str) -> bool:
        try:
            return (await self.client.get(url + "/health", timeout=HEALTH_TIMEOUT_S)).status_code == 200
        except httpx.HTTPError:
            return False

    async def models(self, request: Request) -> Response:
        """A decode server's /v1/models (the served model names are the decode servers')."""
        url = self.decode.pick()
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        try:
            resp = await self.client.get(url + "/v1/models", headers=headers)
        except httpx.HTTPError as err:
            err = unreachable("decode", url, err)
            return JSONResponse(err.body, status_code=err.status)
        if resp.status_code >= 400:
            return JSONResponse(routing.upstream_error(resp.status_code, resp.content), status_code=resp.status_code)
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"))


def create_app(prefill_urls: list[str], decode_urls: list[str], mode: str = "pull",
               timeout_s: float = 300.0) -> FastAPI:
    """The proxy app. ``timeout_s``: limit on each leg's connect, and on each read/write, s."""
    router = Router(prefill_urls, decode_urls, mode, timeout_s)
    app = FastAPI(title="kvtier-proxy", lifespan=router.lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/health")
    async def health() -> Response:
        return await router.health()

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier-proxy", description="OpenAI-compatible router that splits "
                                     "each request into a prefill leg and a decode leg (vLLM P/D).")
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill server, e.g. http://host:8100 (repeat for several)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode server, e.g. http://host:8200 (repeat for several)")
    parser.add_argument("--mode", choices=MODES, default="pull",
                        help="pull: D reads P's KV after P's leg; push: P pushes KV while D waits (default: pull)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="limit on each leg's connect and each read/write, s (default: 300)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every leg; our line per request says more
    app = create_app(args.prefill, args.decode, args.mode, args.timeout_s)
    log.info("kvtier-proxy on http://%s:%d, mode=%s, prefill=%s, decode=%s", args.host, args.port, args.mode,
             args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, access_log=False)  # one log line a request is ours


if __name__ == "__main__":
    main()
