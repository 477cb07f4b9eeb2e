"""One engine process of ``kvtier-bench engine``: a CUDA vLLM with kvtier, with vLLM's own
``OffloadingConnector``, or with no connector, running the rounds its parent planned.

``python -m kvtier.bench.engine_child --child SPEC.json`` prints one line ``RESULT {json}``.

SPEC: ``{"model": dir, "connector": "none" | "kvtier" | "offload", "kvtier": extra config,
"offload_gib": GiB, "num_gpu_blocks": blocks or "kv_cache_bytes": bytes (the engine's KV cache),
"max_model_len": tokens, "block_size": tokens or absent, "gpu_memory_utilization": fraction,
"count_transfers": bool, "scheduler": bool (kvtier's scheduler_cls),
"profile_dir": absolute path or absent, "rounds": [round, ...]}``. A round is ``{"prompts":
[[token ids]], "max_tokens": int, "reset": bool, "pause_s": s, "profile": tag}`` (one ``generate``
call; ``reset`` empties vLLM's prefix cache first; ``profile``: the call runs under vLLM's torch
profiler, its traces go to ``profile_dir/tag``, see :mod:`kvtier.bench.engine_profile`), or
``{"sessions": [[ids]], "turns": [[[ids] per session] per round], "max_tokens": int}`` (a
multi-turn chat: every round sends all sessions at once; a session's next prompt is its last
prompt, the tokens it got back and the new user turn; with ``profile``, one more turn, not
measured, runs under the profiler). A round may also carry ``"until_files": {"dir": path,
"count": n, "timeout_s": s}``: after its call, it waits until ``dir`` holds ``n`` files of one size
(a disk tier's write-through has landed: nothing of it is lost when the engine ends), ``timeout_s``
passed, or no file came or grew for :data:`STALL_S` (files the tier evicted never come); the round's
``files`` says what it found.

RESULT: ``{"start_s": seconds to build the engine, "hybrid": whether vLLM kept its hybrid KV cache
manager on (None: this vLLM does not say), "rounds": [{"seconds", "outputs": [{"tokens", "cached", "id"}],
"transfers", "steps"}], "profiles": {tag: [trace paths]}}``; a multi-turn round gives one entry per chat round,
with its ``prompt_tokens`` (summed over the sessions).

``count_transfers``: the engine keeps stats (``disable_log_stats=False``) and each round's
``transfers`` is what the connector reported during the round, reduced as vLLM logs it ("KV
Transfer metrics": kvtier's ``loaded_bytes``, ``hit_tokens_cpu``, ...); ``{}`` when it reported
nothing, None when the connector keeps no stats or they were not asked for. With ``count_transfers``
a round's ``steps`` also says how the engine ran it (:func:`tap_steps`): two runs of one workload
that differ in time differ either in their number of steps (smaller batches, preemptions) or in
the time a step takes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

from kvtier.bench.common import files_under
from kvtier.bench.engine_model import has_weights
from kvtier.bench.engine_profile import collect, profiler_kwargs
from kvtier.bench.ttft import SCHEDULER

STALL_S = 60.0  # seconds without a new or growing file after which a wait for the write-through gives up


def build_engine(spec: dict):
    """The ``vllm.LLM`` that ``spec`` asks for (token-id prompts; dummy weights unless its model
    directory holds weights; eager unless ``spec["cuda_graphs"]``)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra = {}
    if spec["connector"] == "kvtier":
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="kvtier", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["kvtier"])
    elif spec["connector"] == "offload":
        extra["kv_offloading_size"] = spec["offload_gib"]
    if spec.get("scheduler"):  # kvtier's scheduler: its look-ahead promotes the disk chunks of waiting prompts
        extra["scheduler_cls"] = SCHEDULER
    if spec.get("num_gpu_blocks"):
        extra["num_gpu_blocks_override"] = spec["num_gpu_blocks"]
    if spec.get("block_size"):  # tokens; a CPU vLLM's default is 128
        extra["block_size"] = spec["block_size"]
    if spec.get("kv_cache_bytes"):  # bytes, not blocks: a hybrid model's block holds fewer layers
        extra["kv_cache_memory_bytes"] = spec["kv_cache_bytes"]
    if spec.get("profile_dir"):
        extra.update(profiler_kwargs(spec["profile_dir"]))
    weights = "auto" if has_weights(spec["model"]) else "dummy"
    return LLM(model=spec["model"], load_format=weights, skip_tokenizer_init=True, seed=0,
               enforce_eager=not spec.get("cuda_graphs"),
               max_model_len=spec["max_model_len"], gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.85),
               tensor_parallel_size=spec.get("tp", 1),
               disable_log_stats=not spec.get("count_transfers"), **extra)


def hybrid_manager_on(llm) -> bool | None:
    """Whether vLLM kept its hybrid KV cache manager on in ``llm`` (None: this vLLM does not say)."""
    config = getattr(llm.llm_engine, "vllm_config", None)
    off = getattr(getattr(config, "scheduler_config", None), "disable_hybrid_kv_cache_manager", None)
    return None if off is None else not off


def _tap_outputs(llm, see: Callable[[object], None]) -> None:
    """Have ``see`` look at every batch of outputs (``EngineCoreOutputs``) the engine core sends
    ``llm``, where they arrive (:func:`tap_transfers` and :func:`tap_steps` both do)."""
    core = llm.llm_engine.engine_core
    get_output = core.get_output

    def get_output_seen():
        outputs = get_output()
        see(outputs)
        return outputs

    core.get_output = get_output_seen


def tap_transfers(llm) -> Callable[[], dict | None]:
    """Collect the connector stats every engine step sends ``llm``; returns a function that gives
    those since its last call, aggregated and reduced by the connector's own stats class (None:
    the connector keeps none).

    Read where the engine core's outputs arrive, not from the stat loggers: some vLLM releases
    hand the loggers only the stats of steps that produced a token, and a load reports its bytes
    in the step that finishes it, which produces none.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    engine = llm.llm_engine
    transfer = engine.vllm_config.kv_transfer_config
    stats_cls = KVConnectorFactory.get_connector_class(transfer) if transfer and transfer.kv_connector else None
    if stats_cls is None or stats_cls.build_kv_connector_stats() is None:
        return lambda: None
    payloads: list[dict] = []

    def see(outputs) -> None:
        stats = getattr(outputs, "scheduler_stats", None)
        if stats is not None and getattr(stats, "kv_connector_stats", None):
            payloads.append(stats.kv_connector_stats)

    _tap_outputs(llm, see)

    def take() -> dict:
        total = None
        for data in payloads:
            one = stats_cls.build_kv_connector_stats(data=data)
            total = one if total is None else total.aggregate(one)
        payloads.clear()
        return {} if total is None or total.is_empty() else total.reduce()

    return take


def tap_steps(llm) -> Callable[[], dict | None]:
    """Count the engine steps whose outputs reach ``llm``; returns a function that gives, since its
    last call, ``{"steps": n, "running_mean": requests running per step, "running_max",
    "preempted": requests the scheduler preempted}`` (None: the engine sent no stats).

    Read from each step's scheduler stats and its requests' PREEMPTED events, which vLLM sends only
    when it keeps stats (``disable_log_stats=False``).
    """
    from vllm.v1.engine import EngineCoreEventType

    running: list[int] = []
    preempted = [0]

    def see(outputs) -> None:
        stats = getattr(outputs, "scheduler_stats", None)
        if stats is not None:
            running.append(stats.num_running_reqs)
        for out in getattr(outputs, "outputs", None) or ():
            preempted[0] += sum(e.type == EngineCoreEventType.PREEMPTED for e in out.events or ())

    _tap_outputs(llm, see)

    def take() -> dict | None:
        got = None if not running else {"steps": len(running), "running_mean": round(sum(running) / len(running), 2),
                                        "running_max": max(running), "preempted": preempted[0]}
        running.clear()
        preempted[0] = 0
        return got

    return take


def run_child(spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    begin = time.perf_counter()
    llm = build_engine(spec)
    result = {"start_s": time.perf_counter() - begin, "hybrid": hybrid_manager_on(llm), "rounds": [], "profiles": {}}
    transfers = tap_transfers(llm) if spec.get("count_transfers") else (lambda: None)
    steps = tap_steps(llm) if spec.get("count_transfers") else (lambda: None)

    def generate(prompts: list[list[int]], max_tokens: int) -> tuple[float, list, dict | None, dict | None]:
        """Seconds, outputs, what the connector reported meanwhile and the engine's steps (see the
        module docstring)."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        transfers(), steps()  # drop what earlier rounds left
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, outs, transfers(), steps()

    for rnd in spec["rounds"]:
        time.sleep(rnd.get("pause_s", 0))
        if rnd.get("reset"):
            llm.reset_prefix_cache()
        if "sessions" in rnd:
            contexts = [list(s) for s in rnd["sessions"]]
            for turn in rnd["turns"]:
                contexts = [c + t for c, t in zip(contexts, turn)]
                seconds, outs, moved, ran = generate(contexts, rnd["max_tokens"])
                replies = [list(o.outputs[0].token_ids) for o in outs]
                result["rounds"].append({"seconds": seconds, "transfers": moved, "steps": ran,
                                         "prompt_tokens": sum(map(len, contexts)),
                                         "outputs": [{"tokens": r, "cached": o.num_cached_tokens or 0}
                                                     for r, o in zip(replies, outs)]})
                contexts = [c + r for c, r in zip(contexts, replies)]
            if rnd.get("profile"):  # one more turn, not measured, under the profiler
                llm.start_profile()
                generate([c + t for c, t in zip(contexts, rnd["turns"][0])], rnd["max_tokens"])
                llm.stop_profile()
                result["profiles"][rnd["profile"]] = collect(spec["profile_dir"], rnd["profile"])
            continue
        if rnd.get("profile"):
            llm.start_profile()
        seconds, outs, moved, ran = generate(rnd["prompts"], rnd.get("max_tokens", 1))
        if rnd.get("profile"):
            llm.stop_profile()  # the workers write their traces before it returns
            result["profiles"][rnd["profile"]] = collect(spec["profile_dir"], rnd["profile"])
        result["rounds"].append({"seconds": seconds, "transfers": moved, "steps": ran, "outputs": [
            {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0, "id": o.request_id}
            for o in outs]})
        if "until_files" in rnd:
            result["rounds"][-1]["files"] = wait_for_files(**rnd["until_files"])
    return result


def wait_for_files(dir: str, count: int, timeout_s: float, stall_s: float = STALL_S) -> dict:  # noqa: A002 - spec key
    """Wait until ``dir`` holds ``count`` files (or more), all of one size, or ``timeout_s`` passed,
    or nothing in it changed for ``stall_s`` (no more writes are coming: files the tier evicted, say);
    ``{"files": n, "sizes": distinct sizes, "waited_s": s, "landed": bool, "stalled": bool}``."""
    start = changed = time.monotonic()
    seen = None
    while True:
        sizes = [os.path.getsize(file) for file in files_under(dir)]
        landed = len(sizes) >= count and len(set(sizes)) <= 1
        now = time.monotonic()
        if (state := (len(sizes), sum(sizes))) != seen:  # a file came or grew
            seen, changed = state, now
        stalled = not landed and now - changed > stall_s
        if landed or stalled or now - start > timeout_s:
            return {"files": len(sizes), "sizes": len(set(sizes)), "waited_s": round(now - start, 1),
                    "landed": landed, "stalled": stalled}
        time.sleep(0.2)  # polling the files the engine's disk tier writes


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--child":
        sys.exit("usage: python -m kvtier.bench.engine_child --child SPEC.json")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    with open(sys.argv[2]) as f:
        out = run_child(json.load(f))
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # the parent ends the engine's process group
