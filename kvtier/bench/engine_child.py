"""One engine process of ``kvtier-bench engine``: a CUDA vLLM with kvtier, with vLLM's own
``OffloadingConnector``, or with no connector, running the rounds its parent planned.

``python -m kvtier.bench.engine_child --child SPEC.json`` prints one line ``RESULT {json}``.

SPEC: ``{"model": dir, "connector": "none" | "kvtier" | "offload", "kvtier": extra config,
"offload_gib": GiB, "num_gpu_blocks": blocks, "max_model_len": tokens, "gpu_memory_utilization":
fraction, "rounds": [round, ...]}``. A round is ``{"prompts": [[token ids]], "max_tokens": int,
"reset": bool, "pause_s": s}`` (one ``generate`` call; ``reset`` empties vLLM's prefix cache
first), or ``{"sessions": [[ids]], "turns": [[[ids] per session] per round], "max_tokens": int}``
(a multi-turn chat: every round sends all sessions at once; a session's next prompt is its last
prompt, the tokens it got back and the new user turn).

RESULT: ``{"start_s": seconds to build the engine, "rounds": [{"seconds", "outputs": [{"tokens",
"cached"}]}]}``; a multi-turn round gives one entry per chat round.
"""

from __future__ import annotations

import json
import os
import sys
import time


def build_engine(spec: dict):
    """The ``vllm.LLM`` that ``spec`` asks for (dummy weights, token-id prompts, eager)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra = {}
    if spec["connector"] == "kvtier":
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="kvtier", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["kvtier"])
    elif spec["connector"] == "offload":
        extra["kv_offloading_size"] = spec["offload_gib"]
    if spec.get("num_gpu_blocks"):
        extra["num_gpu_blocks_override"] = spec["num_gpu_blocks"]
    return LLM(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, seed=0,
               max_model_len=spec["max_model_len"], gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.85),
               disable_log_stats=True, **extra)


def run_child(spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    begin = time.perf_counter()
    llm = build_engine(spec)
    result = {"start_s": time.perf_counter() - begin, "rounds": []}

    def generate(prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, outs

    for rnd in spec["rounds"]:
        time.sleep(rnd.get("pause_s", 0))
        if rnd.get("reset"):
            llm.reset_prefix_cache()
        if "sessions" in rnd:
            contexts = [list(s) for s in rnd["sessions"]]
            for turn in rnd["turns"]:
                contexts = [c + t for c, t in zip(contexts, turn)]
                seconds, outs = generate(contexts, rnd["max_tokens"])
                replies = [list(o.outputs[0].token_ids) for o in outs]
                contexts = [c + r for c, r in zip(contexts, replies)]
                result["rounds"].append({"seconds": seconds, "outputs": [
                    {"tokens": r, "cached": o.num_cached_tokens or 0} for r, o in zip(replies, outs)]})
            continue
        seconds, outs = generate(rnd["prompts"], rnd.get("max_tokens", 1))
        result["rounds"].append({"seconds": seconds, "outputs": [
            {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0} for o in outs]})
    return result


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--child":
        sys.exit("usage: python -m kvtier.bench.engine_child --child SPEC.json")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    with open(sys.argv[2]) as f:
        out = run_child(json.load(f))
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # the parent ends the engine's process group
