"""One timed ``kvtier-bench pd`` request and what is read around it: the :class:`Sample` it gives
(times in ms), the streamed completion timed at the client, the engines' counters before and after
(``/metrics``), and the proxy's log line with its legs.

A sample's ``row`` is one of :data:`ROWS`: ``recompute`` and ``local_hit`` on the server without
a connector, ``pull`` and ``push`` through kvtier-proxy in front of P and D.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.bench.common import BenchError

ROWS = ("recompute", "local_hit", "pull", "push")
DONE_TIMEOUT_S = 30.0  # for an engine's metrics to show a request finished, s

# Engine counters read around each request (name, labels); deltas give one request's share.
WATCHED = {
    "done": ("vllm:request_success_total", {}),
    "busy": ("vllm:num_requests_running", {}),
    "queued": ("vllm:num_requests_waiting", {}),
    "prefill_s": ("vllm:request_prefill_time_seconds_sum", {}),
    "queue_s": ("vllm:request_queue_time_seconds_sum", {}),
    "external": ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    "computed": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "cache_hit": ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
}
_PROXY_LINE = re.compile(r"mode=(\w+) p_ms=(\S+) d_ttfb_ms=(\S+) tokens=(\S+)")


@dataclass
class Sample:
    """One timed request. ``legs``: where its time went, ms (and D's computed tokens)."""

    row: str
    prompt_tokens: int
    repeat: int
    ttft_ms: float
    total_ms: float
    text: str
    token_ids: list[int]  # the generated tokens
    identical: bool | None = None  # tokens and text equal to R's cold answer for the same prompt
    moved: int | None = None  # tokens D loaded from outside (P/D rows)
    transferred: bool | None = None  # moved >= prompt_tokens - 1 (P/D rows)
    proxy_mode: str | None = None  # the flow the proxy used: pull or push (P/D rows)
    others_cpu_s: float = 0.0  # CPU time processes not of this bench used during the request, s
    legs: dict = field(default_factory=dict)


def stream_completion(client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, str, list[int]]:
    """POST a streamed greedy completion; returns (seconds to the first streamed token, seconds to
    the end of the stream, generated text, generated token ids). Raises BenchError on an error answer."""
    import httpx

    from kvtier.bench.servers import SERVED_NAME

    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    try:
        first, parts, ids = _read_stream(client, url, body)
    except httpx.HTTPError as err:
        raise BenchError(f"{url}: {type(err).__name__}: {err}") from err
    end = time.perf_counter()
    if first is None:
        raise BenchError(f"{url} streamed no token")
    return first - start, end - start, "".join(parts), ids


def _read_stream(client, url: str, body: dict) -> tuple[float | None, list[str], list[int]]:
    """(perf_counter at the first streamed token, text parts, token ids) of one streamed completion."""
    first, parts, ids = None, [], []
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise BenchError(f"{url} answered {resp.status_code}: {resp.read()[:500].decode(errors='replace')}")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                continue  # read on to the end: leaving early reads as a client gone to the proxy
            event = json.loads(data)
            if "error" in event:
                raise BenchError(f"{url} streamed an error: {event['error']}")
            choices = event.get("choices") or []
            if choices:
                # vLLM sends a completion chunk per new token, even when its text is still empty.
                first = first or time.perf_counter()
                parts.append(choices[0].get("text") or "")
                ids += choices[0].get("token_ids") or []
    return first, parts, ids


def snapshot(url: str) -> dict[str, float]:
    """The WATCHED values at ``url``/metrics (one GET)."""
    from kvtier.bench.servers import metrics

    samples = metrics(url)
    return {key: sum(v for n, labels, v in samples if n == name and all(labels.get(k) == w for k, w in want.items()))
            for key, (name, want) in WATCHED.items()}


def wait_done(urls: dict[str, str], before: dict[str, dict]) -> dict[str, dict]:
    """Wait until each engine counts one more finished request than in ``before`` and has none
    running or waiting; returns their snapshots. vLLM records a request's histograms when it finishes,
    which can trail the client's last byte slightly."""
    deadline = time.monotonic() + DONE_TIMEOUT_S
    while True:
        now = {name: snapshot(url) for name, url in urls.items()}
        if all(now[n]["done"] > before[n]["done"] and not now[n]["busy"] and not now[n]["queued"] for n in urls):
            return now
        if time.monotonic() > deadline:
            raise BenchError(f"engines {sorted(urls)} did not report the request finished within {DONE_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def proxy_lines(log_path: Path) -> list[tuple[str, float | None, float | None]]:
    """(mode, P leg ms, D leg's time to first byte ms) of each request the proxy logged, in order."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    as_ms = lambda v: None if v == "-" else float(v)  # noqa: E731
    return [(m[1], as_ms(m[2]), as_ms(m[3])) for m in _PROXY_LINE.finditer(text)]

