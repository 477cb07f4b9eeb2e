"""One engine of a P/D pair that stays up: a vLLM ``LLM`` with kvtier, with vLLM's
``NixlConnector`` or ``NixlPushConnector`` or with no connector, answering one request per line of
its stdin.

``python -m kvtier.bench.pd_child SPEC.json`` prints ``READY {"start_s": s}`` once the engine is
built, then for each request line ``{"prompt": [ids], "max_tokens": n, "params": {...} | null,
"logprobs": k | null, "request_id": id | null}`` one line ``OUT {"seconds": s, "tokens": [ids],
"cached": tokens, "params": {...} | null, "logprobs": [{id: logprob}] | null}``: ``params`` in is the request's
``kv_transfer_params``, out is what the engine returned (a prefill engine's answer for the decode
engine); ``seconds`` is the wall time of ``generate`` (with ``max_tokens`` 1: time to first token).
``request_id`` (decimal digits: ``LLM`` sorts its answers by ``int(request_id)``) names the
request in the engine (vLLM appends its random suffix), as a proxy's ``X-Request-Id`` does for
both legs: ``NixlPushConnector`` pairs P's finished request with D's by that name; without it the
``LLM``'s own counter (0, 1, ...) names it. An empty line or end of input ends the engine.

SPEC: ``{"model": dir, "connector": "kvtier" | "nixl" | "nixl-push" | "none", "kvtier": extra
config, "engine_id": NIXL engine id | null, "load_format": "dummy" | "auto",
"gpu_memory_utilization": fraction, "max_model_len": tokens, "block_size": tokens | null,
"engine_args": further LLM(...) keyword arguments, "profile_dir": absolute path | absent}``. The
engine runs greedy, with token-id prompts only, and eager unless ``engine_args`` sets
``enforce_eager`` false. With ``profile_dir`` the engine has vLLM's torch profiler on, and a
request line with ``"profile": tag`` runs under it: its traces go to ``profile_dir/tag`` and its
``OUT`` record lists them (``"traces"``; see :mod:`kvtier.bench.engine_profile`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from kvtier.bench.engine_profile import collect, profiler_kwargs  # stdlib only: vLLM is imported where used

NIXL_CONNECTORS = {"nixl": "NixlConnector", "nixl-push": "NixlPushConnector"}


def _transfer_config(spec: dict):
    from importlib.metadata import entry_points

    from vllm.config import KVTransferConfig

    if spec["connector"] in NIXL_CONNECTORS:
        return KVTransferConfig(kv_connector=NIXL_CONNECTORS[spec["connector"]], kv_role="kv_both",
                                engine_id=spec.get("engine_id"))
    if spec["connector"] != "kvtier":
        return None
    # Where kvtier is only on the path (not installed), vLLM finds the connector by module.
    named = ({"kv_connector": "kvtier"} if any(ep.name == "kvtier" for ep in entry_points(group="vllm.general_plugins"))
             else {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.engines.vllm.connector"})
    return KVTransferConfig(**named, kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config=spec.get("kvtier") or {})


def build_engine(spec: dict):
    """The ``vllm.LLM`` ``spec`` asks for."""
    from vllm import LLM

    kw = {"enforce_eager": True}  # engine_args may turn it off (pd-engines --cuda-graphs)
    if spec["connector"] != "none":
        kw["kv_transfer_config"] = _transfer_config(spec)
    if spec.get("block_size"):
        kw["block_size"] = spec["block_size"]
    kw.update(spec.get("engine_args") or {})  # e.g. {"enable_prefix_caching": True} for a Mamba hybrid
    if spec.get("profile_dir"):
        kw.update(profiler_kwargs(spec["profile_dir"]))
    return LLM(model=spec["model"], load_format=spec.get("load_format", "dummy"), skip_tokenizer_init=True,
               seed=0, max_model_len=spec["max_model_len"],
               gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.35), disable_log_stats=True, **kw)


@contextlib.contextmanager
def request_named(llm, request_id: str | None):
    """The next request ``llm`` adds is named ``request_id`` (``LLM`` names each request
    ``str(next(llm.request_counter))``); None leaves the counter as it is."""
    if request_id is None:
        yield
        return
    if not hasattr(llm, "request_counter"):
        raise RuntimeError("this vLLM's LLM has no request_counter: a request cannot be given an id")
    counter, llm.request_counter = llm.request_counter, iter([request_id])
    try:
        yield
    finally:
        llm.request_counter = counter


def _own_hits(params: dict) -> dict:
    """``params`` without ``remote_prefill_cached_tokens``: vLLM 0.33's P adds it to what it
    publishes, and its D then reports P's own prefix hit as the request's cached tokens; without it
    D reports its own (local hit + what its connector loaded), which is what this harness checks."""
    return {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}


def answer(llm, request: dict, profile_dir: str | None = None) -> dict:
    """Run one request line; the ``OUT`` record (``profile_dir``: where the engine's profiler
    writes, for a line that asks for a profile)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": _own_hits(request["params"])} if request.get("params") else None
    params = SamplingParams(temperature=0.0, max_tokens=request.get("max_tokens", 1), ignore_eos=True,
                            detokenize=False, logprobs=request.get("logprobs"), extra_args=extra)
    tag = request.get("profile") if profile_dir else None
    if tag:
        llm.start_profile()
    with request_named(llm, request.get("request_id")):
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=request["prompt"])], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
    traces = None
    if tag:
        llm.stop_profile()  # the workers write their traces before it returns
        traces = collect(profile_dir, tag)
    logprobs = None
    if out.outputs[0].logprobs is not None:
        logprobs = [{str(t): lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]
    return {"seconds": seconds, "tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
            "params": getattr(out, "kv_transfer_params", None), "logprobs": logprobs, "traces": traces}


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    begin = time.perf_counter()
    llm = build_engine(spec)
    print("READY " + json.dumps({"start_s": time.perf_counter() - begin}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        print("OUT " + json.dumps(answer(llm, json.loads(line), spec.get("profile_dir"))), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m kvtier.bench.pd_child SPEC.json")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    main(sys.argv[1])
    os._exit(0)  # the parent ends the engine's process group
