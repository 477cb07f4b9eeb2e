"""kvtier in vLLM's OpenAI-compatible server on CUDA, as a user serves it: completions on token
ids (the model has no tokenizer), ``/reset_prefix_cache`` (dev mode), and ``/metrics``.

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -m gpu tests/gpu``.

One server per TP size (1, and 2 where two GPUs are visible), in its own process group (killed
at the end); at TP=2 rank 0's lookup answers for both ranks, and each rank loads its own shard.
The same 1801-token prompt (seven chunks and 9 tokens) is sent three times: computed; again, a hit in vLLM's own prefix cache;
after ``POST /reset_prefix_cache``, loaded from kvtier. The third answer must equal the second
bit for bit (same cached length, same suffix: the same computation on the same KV bytes) and the
first closely (see gpu_engines). What was loaded shows in the response's
``usage.prompt_tokens_details.cached_tokens`` and on ``/metrics``: vLLM's
``prompt_tokens_by_source_total{source="external_kv_transfer"}`` and kvtier's
``kvtier_hit_tokens_total`` (whichever this vLLM release exposes) grow by the loaded tokens.

Token ids come back in ``choices[0].token_ids`` (``return_token_ids``) where the server knows
that field, else from the logprobs' ``token_id:N`` strings (``return_tokens_as_token_ids``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import gpu_engines as g

if (reason := g.skip_reason()) is not None:  # no CUDA or no CUDA vLLM: skip this module at collection
    pytest.skip(reason, allow_module_level=True)

from kvtier.bench.servers import Server, free_port, metrics, start_group, wait_ready  # noqa: E402 - after the skip

pytestmark = pytest.mark.gpu

P = g.prompt(71, 7 * g.CHUNK + 9)
FULL = 7 * g.CHUNK
MAX_TOKENS = 16
EXTERNAL = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
KVTIER_HITS = ("vllm:kvtier_hit_tokens_total", {})
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def server_args(model: str, port: int, tp: int = 1) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--skip-tokenizer-init", "--enforce-eager", "--seed", "0",
            "--gpu-memory-utilization", str(g.GPU_MEMORY_UTILIZATION), "--block-size", str(g.BLOCK),
            "--max-model-len", str(g.MAX_MODEL_LEN), "--max-num-batched-tokens", str(g.MAX_BATCHED),
            "--enable-prompt-tokens-details", "--tensor-parallel-size", str(tp),
            "--kv-transfer-config", json.dumps(g.transfer_config(g.kvtier_config()))]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def served(request, gpu_model, tmp_path_factory):
    tp = request.param
    g.skip_without_gpus(tp, f"TP={tp}")
    tmp = tmp_path_factory.mktemp(f"gpu-served-tp{tp}")
    port, log_path = free_port(), tmp / "server.log"
    env = g.child_env(multiprocess=True, extra={"VLLM_SERVER_DEV_MODE": "1"})
    with open(log_path, "wb") as log:
        proc = start_group(server_args(gpu_model, port, tp), stdout=log, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, env=env, cwd=str(g.REPO))
    server = Server(proc, port, log_path)
    try:
        wait_ready([server], timeout_s=g.ENGINE_TIMEOUT_S)
        yield {"server": server, "model": gpu_model}
    finally:
        server.stop()  # SIGTERM to the group, SIGKILL after a grace period
        g.kill_group(proc)


def post(url: str, body: dict | None = None, timeout_s: float = 120) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with _NO_PROXY.open(request, timeout=timeout_s) as resp:
            text = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def complete(served: dict) -> dict:
    """One greedy completion of P: {"tokens", "top", "cached"} (cached None if not reported)."""
    status, body = post(served["server"].url + "/v1/completions", {
        "model": served["model"], "prompt": P, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
        "logprobs": g.TOP_LOGPROBS, "return_tokens_as_token_ids": True, "return_token_ids": True})
    assert status == 200, f"completion failed ({status}): {body}\n{served['server'].log_tail()}"
    choice = body["choices"][0]
    logprobs = choice.get("logprobs") or {}
    tokens = choice.get("token_ids")
    if tokens is None:  # a release without return_token_ids: the logprobs name each token "token_id:N"
        tokens = [_token_id(t) for t in logprobs["tokens"]]
    top = [sorted(([_token_id(t), lp] for t, lp in pos.items()), key=lambda x: (-x[1], x[0]))
           for pos in (logprobs.get("top_logprobs") or [])]
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    return {"tokens": list(tokens), "top": top or None, "cached": details.get("cached_tokens")}


def _token_id(name: str) -> int:
    return int(name.split(":", 1)[1]) if name.startswith("token_id:") else int(name)


def sample(url: str, name: str, labels: dict) -> float | None:
    """Sum of the samples of ``name`` with ``labels``; None when /metrics has no sample of that name."""
    found = [(have, v) for n, have, v in metrics(url) if n == name]
    if not found:
        return None
    return sum(v for have, v in found if all(have.get(k) == str(x) for k, x in labels.items()))


def test_served_openai_server(served):
    url = served["server"].url
    computed = complete(served)
    local = complete(served)
    # Let the first request's chunks land in the CPU tier (kvtier's saved-bytes counter, where it is exposed).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (sample(url, "vllm:kvtier_saved_bytes_total", {}) or 0) > 0:
        time.sleep(0.2)
    before = {name: sample(url, *metric) for name, metric in (("external", EXTERNAL), ("kvtier", KVTIER_HITS))}
    status, body = post(url + "/reset_prefix_cache")
    assert status == 200, f"/reset_prefix_cache answered {status}: {body} (needs VLLM_SERVER_DEV_MODE=1)"
    reloaded = complete(served)

    assert len(reloaded["tokens"]) == MAX_TOKENS
    assert computed["cached"] in (None, 0)
    assert local["cached"] in (None, g.local_hit(len(P)))
    assert reloaded["cached"] in (None, FULL), f"kvtier loaded {reloaded['cached']} of {FULL} tokens"
    g.assert_strict(reloaded, local, "served: reload vs the same hit in vLLM's prefix cache")
    g.assert_close(reloaded, computed, "served: reload vs recompute")

    # /metrics: vLLM's and kvtier's counts of loaded tokens move by what was loaded (stats reach the
    # frontend a moment after the step: poll).
    grown: dict = {}
    deadline = time.monotonic() + 30
    while True:
        after = {name: sample(url, *metric) for name, metric in (("external", EXTERNAL), ("kvtier", KVTIER_HITS))}
        grown = {name: after[name] - (before[name] or 0) for name in after if after[name] is not None}
        if all(v >= FULL for v in grown.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(f"served: cached tokens {computed['cached']}, {local['cached']}, {reloaded['cached']}; "
          f"/metrics grew by {grown}")
    assert reloaded["cached"] is not None or grown, "neither the response nor /metrics shows what was loaded"
    for name, value in grown.items():
        assert value == FULL, f"/metrics {name}: grew by {value}, {FULL} loaded ({grown})"
    if not grown:
        import warnings

        warnings.warn("this vLLM's /metrics has neither prompt_tokens_by_source_total nor kvtier_hit_tokens_total")
