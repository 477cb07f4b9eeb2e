"""Pure helpers of the P/D router: the two legs' request bodies, error bodies, least-outstanding choice.

No I/O here, so every rule of vLLM's two-leg protocol can be read (and tested) in one place.
"""

from __future__ import annotations

import json

# Pull mode: P computes the prompt and keeps its KV for D to read; D learns where from P's answer.
PULL_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                       "remote_block_ids": None, "remote_host": None, "remote_port": None}

# Sampling limits that would make P generate (or stream) more than the one token it needs.
_PREFILL_DROPPED = ("min_tokens", "stream_options", "max_completion_tokens")


def prefill_body(body: dict, kv_params: dict) -> dict:
    """The client's ``body`` as P must see it: one token, not streamed, with ``kv_params``."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out.update(kv_transfer_params=dict(kv_params), max_tokens=1, stream=False)
    return out


def decode_body(body: dict, kv_params: dict | None) -> dict:
    """The client's ``body`` unchanged, plus ``kv_params`` (none: D recomputes the prompt)."""
    out = dict(body)
    out.pop("kv_transfer_params", None)  # a client's own params must not reach D as if P sent them
    if kv_params is not None:
        out["kv_transfer_params"] = kv_params
    return out


def push_prefill_params(transfer_id: str) -> dict:
    """Push mode, P's leg: compute, then push the blocks tagged ``transfer_id`` to D."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def push_decode_params(endpoint: dict, transfer_id: str) -> dict:
    """Push mode, D's leg: expect blocks tagged ``transfer_id`` from P's transfer ``endpoint``
    (the fields of an earlier P answer's kv_transfer_params)."""
    return {**endpoint, "remote_request_id": transfer_id, "transfer_id": transfer_id,
            "do_remote_prefill": True, "do_remote_decode": False}


def endpoint_fields(kv_params: dict) -> dict:
    """What a P answer's kv_transfer_params says about P itself (all but the one request's id)."""
    return {k: v for k, v in kv_params.items() if k != "remote_request_id"}


def error_body(message: str, kind: str, status: int) -> dict:
    """OpenAI-style error body, as vLLM's server writes them."""
    return {"error": {"message": message, "type": kind, "code": status}}


def upstream_error(status: int, content: bytes) -> dict:
    """Error body for an engine's error answer: the engine's own message and type where it has one."""
    message, kind = content.decode("utf-8", "replace"), "upstream_error"
    try:
        err = json.loads(content).get("error")
    except (ValueError, AttributeError):
        err = None
    if isinstance(err, dict):  # keep the engine's other fields (vLLM's "param")
        body = error_body(str(err.get("message", message)), str(err.get("type", kind)), status)
        return {"error": {**err, **body["error"]}}
    if isinstance(err, str):  # some servers answer {"error": "text"}
        message = err
    return error_body(message, kind, status)


class Pool:
    """Servers of one role; picks the one with the fewest requests in flight (ties: the first)."""

    def __init__(self, urls: list[str]):
        if not urls:
            raise ValueError("a pool needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.outstanding = {u: 0 for u in self.urls}

    def pick(self) -> str:
        """The least loaded URL, without counting a request on it."""
        return min(self.urls, key=self.outstanding.__getitem__)  # min keeps the first of equals

    def acquire(self) -> str:
        """The least loaded URL, counting one more request on it until ``release``."""
        url = self.pick()
        self.outstanding[url] += 1
        return url

    def release(self, url: str) -> None:
        self.outstanding[url] -= 1
