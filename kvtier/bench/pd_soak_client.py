"""``kvtier-bench pd-soak``'s requests: through ``kvtier-proxy``, or as the proxy's two legs sent by
the harness itself (with a fault between or during them), and how each one ended.

The legs are the proxy's own (:mod:`kvtier.proxy.routing`): P gets the client's body with
``max_tokens=1`` and ``kv_transfer_params`` asking it to keep the KV for a decode engine, D gets
the body with what P answered in ``kv_transfer_params``; both carry one fresh ``x-request-id``.
Every call is greedy, not streamed, and asks for the generated token ids (``return_token_ids``).
A call that gets no answer within ``timeout_s`` (``pd_timeout_ms`` + 1 s) is *hung*; one that
ends in an HTTP error or a broken connection *failed*; an HTTP 200 is *ok* or *wrong* as its
tokens equal the recompute's or not (:func:`kvtier.bench.pd_soak_plan.check_answer`).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from kvtier.bench.pd_soak_plan import Request, check_answer


@dataclass
class Outcome:
    """How one request ended. ``start_s`` / ``end_s``: since the soak began, s; ``http``: the
    answering call's status (None: no answer); ``expired``: a lease race whose D leg went out
    after P's lease of the blocks ended (``kvtier_lent_until``); ``forged``: the forged messages'
    outcomes (:func:`kvtier.bench.pd_soak_replay.forge`); ``peer_killed``: the request was in
    flight when P or D was killed (set once the run is over)."""

    index: int
    kind: str
    start_s: float
    end_s: float = 0.0
    status: str = "failed"
    http: int | None = None
    error: str | None = None
    tokens: list[int] | None = None
    expired: bool | None = None
    forged: dict = field(default_factory=dict)
    peer_killed: bool = False


def body(req: Request, model: str) -> dict:
    """The client's request body for ``req``."""
    return {"model": model, "prompt": list(req.prompt), "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}


def _judge(out: Outcome, call: Callable) -> dict | None:
    """Run ``call()`` (an httpx response) into ``out``; the JSON answer of a 200, else None."""
    import httpx

    try:
        resp = call()
    except httpx.TimeoutException as exc:
        out.status, out.error = "hung", f"no answer: {type(exc).__name__}"
        return None
    except httpx.HTTPError as exc:
        out.status, out.error = "failed", f"{type(exc).__name__}: {exc}"[:300]
        return None
    out.http = resp.status_code
    if resp.status_code != 200:
        out.status, out.error = "failed", f"HTTP {resp.status_code}: {resp.text[:300]}"
        return None
    try:
        answer = resp.json()
    except ValueError:
        out.status, out.error = "wrong", "HTTP 200 with a body that is not JSON"
        return None
    return answer


def _tokens(answer: dict) -> list[int] | None:
    try:
        return list(answer["choices"][0]["token_ids"])
    except (KeyError, IndexError, TypeError):
        return None


def proxied(client, proxy_url: str, req: Request, model: str, reference: list[int], timeout_s: float,
            out: Outcome) -> None:
    """``req`` through the proxy, judged into ``out``."""
    answer = _judge(out, lambda: client.post(proxy_url + "/v1/completions", json=body(req, model), timeout=timeout_s))
    if answer is not None:
        out.tokens = _tokens(answer)
        out.status = check_answer(out.tokens, reference)


def legs(client, p_url: str, d_url: str, req: Request, model: str, reference: list[int], timeout_s: float,
         out: Outcome, before_d: Callable[[dict], None] | None = None,
         during_d: Callable[[dict], None] | None = None) -> dict | None:
    """``req`` as the proxy's two legs, judged into ``out``; P's ``kv_transfer_params`` (None when
    P's leg failed or P sent none). ``before_d(params)`` runs before D's leg is sent (a delay);
    ``during_d(params)`` runs while D's leg is in flight (a kill, forged messages)."""
    from kvtier.proxy import routing

    headers = {"x-request-id": uuid.uuid4().hex}
    client_body = body(req, model)
    p_body = routing.prefill_body(client_body, routing.PULL_PREFILL_PARAMS)
    answer = _judge(out, lambda: client.post(p_url + "/v1/completions", json=p_body, headers=headers,
                                             timeout=timeout_s))
    if answer is None:
        return None
    params = answer.get("kv_transfer_params")
    if before_d is not None and params:
        before_d(params)
    d_body = routing.decode_body(client_body, params)
    got: dict = {}

    def decode() -> None:
        got["answer"] = _judge(out, lambda: client.post(d_url + "/v1/completions", json=d_body, headers=headers,
                                                        timeout=timeout_s))

    worker = threading.Thread(target=decode, name=f"pd-soak-d-{req.index}", daemon=True)
    worker.start()
    if during_d is not None and params:
        during_d(params)
    worker.join()
    if got.get("answer") is not None:
        out.tokens = _tokens(got["answer"])
        out.status = check_answer(out.tokens, reference)
    return params


def lease_race(req: Request, out: Outcome) -> Callable[[dict], None]:
    """``before_d`` of a lease race: wait the request's injected delay; note whether P's lease of
    the blocks (``kvtier_lent_until``, wall clock) had ended when D's leg went out."""

    def before_d(params: dict) -> None:
        time.sleep(req.delay_s)  # the injected delay itself
        until = params.get("kvtier_lent_until")
        out.expired = None if until is None else time.time() > until

    return before_d
