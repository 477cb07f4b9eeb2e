"""One CUDA vLLM engine, with kvtier or without a connector, running the rounds of a spec; prints
one line ``RESULT {json}``. Started by ``gpu_engines.spawn`` in a process group of its own, which
the test kills at the end (this process leaves with os._exit: no slow engine teardown).

``python tests/gpu/gpu_engine_run.py SPEC.json``. SPEC (rounds as in tests/e2e/engine_run.py;
the RESULT's rounds as in kvtier.bench.ttft's child runner):
  model, kvtier (kv_connector_extra_config, or null: no connector), scheduler (bool: kvtier's
  scheduler_cls, needed for unaligned="handoff"), attention_backend (null or a name such as
  "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"), kv_cache_dtype ("auto" or "fp8"), block_size,
  num_gpu_blocks_override, max_num_seqs, max_model_len, max_num_batched_tokens,
  gpu_memory_utilization, async_scheduling (null: vLLM's default), multiprocess (bool: read by
  the parent, which sets VLLM_ENABLE_V1_MULTIPROCESSING), engine_args (any further LLM(...)
  keyword arguments), logprobs (top logprobs per generated token, 0: none), max_tokens,
  rounds: [{"prompts": [[ids]], "reset": bool, "max_tokens": int, "pause_s": float}],
  wait_disk: {"path", "files", "timeout_s"} (after the rounds: wait until that many chunk files
  are written, so that a fresh engine finds them).
RESULT: {"vllm_version", "async_scheduling", "enforce_eager", "cudagraph_mode", "block_size",
  "kv_cache_dtype", "num_gpu_blocks", "start_s",
  "rounds": [{"seconds", "outputs": [{"tokens", "cached", "top": [[[token, logprob]]]}],
  "admissions": {kvtier plan kind: count}, "preemptions": int|null}], "counts": {...},
  "preemptions": int|null, "disk_files": int|null}. ``cached`` is vLLM's num_cached_tokens
  (its own prefix cache plus what the connector loaded); ``admissions``/``counts`` are kvtier's
  scheduler-side counts (load, partial, handoff, loads_ok, ...), ``preemptions`` vLLM's, both only
  when the engine core runs in this process (else null / {}).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from gpu_engines import transfer_config  # this file's directory is on sys.path when run as a script

SCHEDULER = "kvtier.engines.vllm.scheduler.KvtierScheduler"


def engine_kwargs(spec: dict) -> dict:
    """LLM(...) keyword arguments for ``spec``. Asking for an argument this vLLM does not have
    stops here with its name (except attention_backend, which older releases take from the
    VLLM_ATTENTION_BACKEND environment variable)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    kw = {"model": spec["model"], "skip_tokenizer_init": True, "enforce_eager": True, "seed": 0,
          "max_model_len": spec.get("max_model_len", 8192), "kv_cache_dtype": spec.get("kv_cache_dtype", "auto"),
          "disable_log_stats": True}
    for key in ("block_size", "gpu_memory_utilization", "num_gpu_blocks_override", "max_num_seqs",
                "max_num_batched_tokens", "async_scheduling", "load_format"):
        if spec.get(key) is not None:
            kw[key] = spec[key]
    if spec.get("attention_backend"):
        if "attention_backend" in known:
            kw["attention_backend"] = spec["attention_backend"]
        else:
            os.environ["VLLM_ATTENTION_BACKEND"] = spec["attention_backend"]
    if spec.get("kvtier") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**transfer_config(spec["kvtier"]))
    if spec.get("scheduler"):
        kw["scheduler_cls"] = SCHEDULER
    kw.update(spec.get("engine_args") or {})
    missing = sorted(k for k in kw if k not in known)
    if missing:
        raise SystemExit(f"this vLLM's EngineArgs has no {missing}")
    return kw


def wait_disk(path: str, files: int, timeout_s: float) -> int:
    """Wait until ``files`` chunk files (``*.kv``) under ``path`` exist and none is still
    growing; returns how many there are (fewer on timeout)."""
    deadline = time.monotonic() + timeout_s
    sizes: dict = {}
    while True:
        now = {}
        for p in Path(path).rglob("*.kv"):
            try:
                now[p] = p.stat().st_size
            except OSError:  # replaced or removed meanwhile
                pass
        if len(now) >= files and now == sizes:
            return len(now)
        if time.monotonic() > deadline:
            return len(now)
        sizes = now
        time.sleep(0.25)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from kvtier.engines.vllm import plugin

    plugin.register()  # the entry point does this where kvtier is installed; harmless twice
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    begin = time.perf_counter()
    llm = LLM(**engine_kwargs(spec))
    start_s = time.perf_counter() - begin
    config = getattr(llm.llm_engine, "vllm_config", None)
    scheduler_config = getattr(config, "scheduler_config", None)
    cache_config = getattr(config, "cache_config", None)
    compilation = getattr(config, "compilation_config", None)
    # In-process engine core only (VLLM_ENABLE_V1_MULTIPROCESSING=0): kvtier's scheduler half.
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    side = getattr(scheduler, "kvtier", None) or getattr(getattr(scheduler, "connector", None), "scheduler_side", None)
    preemptions = None
    preempt = getattr(scheduler, "_preempt_request", None)
    if preempt is not None:
        preemptions = [0]

        def counting(*args, **kwargs):
            preemptions[0] += 1
            return preempt(*args, **kwargs)

        scheduler._preempt_request = counting  # the instance attribute wins over the method
    rounds = []
    for rnd in spec["rounds"]:
        time.sleep(rnd.get("pause_s", 0))
        if rnd.get("reset"):
            if llm.reset_prefix_cache() is False:
                raise SystemExit("reset_prefix_cache() refused")
        counts_before = dict(side.counts) if side is not None else {}
        preempted_before = preemptions[0] if preemptions else None
        params = SamplingParams(temperature=0.0, max_tokens=rnd.get("max_tokens", spec.get("max_tokens", 16)),
                                ignore_eos=True, detokenize=False, logprobs=spec.get("logprobs") or None)
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in rnd["prompts"]], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        counts_after = dict(side.counts) if side is not None else {}
        rounds.append({
            "seconds": seconds,
            "outputs": [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
                         "top": _top_logprobs(o.outputs[0].logprobs)} for o in outs],
            "admissions": {k: v - counts_before.get(k, 0) for k, v in counts_after.items()
                           if v != counts_before.get(k, 0)},
            "preemptions": None if preemptions is None else preemptions[0] - preempted_before,
        })
    disk_files = None
    if spec.get("wait_disk"):
        w = spec["wait_disk"]
        disk_files = wait_disk(w["path"], w["files"], w.get("timeout_s", 60))
    result = {
        "vllm_version": getattr(vllm, "__version__", "unknown"),
        "async_scheduling": getattr(scheduler_config, "async_scheduling", None),
        "enforce_eager": getattr(getattr(config, "model_config", None), "enforce_eager", None),
        "cudagraph_mode": str(getattr(compilation, "cudagraph_mode", None)),
        "block_size": getattr(cache_config, "block_size", None),
        "kv_cache_dtype": getattr(cache_config, "cache_dtype", None),
        "num_gpu_blocks": getattr(cache_config, "num_gpu_blocks", None),
        "start_s": start_s, "rounds": rounds,
        "counts": dict(side.counts) if side is not None else {},
        "preemptions": None if preemptions is None else preemptions[0],
        "disk_files": disk_files,
    }
    print("RESULT " + json.dumps(result), flush=True)


def _top_logprobs(logprobs) -> list | None:
    """Per generated token, its top logprobs as [[token, logprob], ...], best first."""
    if logprobs is None:
        return None
    return [sorted(([int(t), float(lp.logprob)] for t, lp in pos.items()), key=lambda x: (-x[1], x[0]))
            for pos in logprobs]


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the parent kills the process group (vLLM's EngineCore with it)
