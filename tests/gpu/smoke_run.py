"""Device smoke: kvtier in a real CUDA vLLM (dummy Llama-3-8B), reload after reset vs connector-less."""
import json, os, sys, time

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    mode, backend, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
    kw = dict(model="/tmp/llama8b", load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=40000, gpu_memory_utilization=0.8, seed=0, kv_cache_dtype=dtype)
    if backend != "default":
        kw["attention_backend"] = backend
    if mode == "kvtier":
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="kvtier", kv_role="kv_both", kv_load_failure_policy="recompute",
                                                    kv_connector_extra_config={"cpu_bytes": 12 << 30})
    elif mode == "offload":
        kw["kv_offloading_size"] = 12
    t0 = time.perf_counter(); llm = LLM(**kw); start = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=int(os.environ.get('MAXTOK', '1')), detokenize=False)
    res = {"mode": mode, "backend": backend, "dtype": dtype, "start_s": start}
    for n in [int(x) for x in os.environ.get('LENS', '8192,32768').split(',')]:
        p = TokensPrompt(prompt_token_ids=[(i * 7919 + n) % 120000 + 100 for i in range(n)])
        rows = []
        for rep in range(3):
            t = time.perf_counter(); o = llm.generate([p], sp, use_tqdm=False)[0]; cold = time.perf_counter() - t
            t = time.perf_counter(); o2 = llm.generate([p], sp, use_tqdm=False)[0]; hit = time.perf_counter() - t
            llm.reset_prefix_cache(); time.sleep(0.5)
            t = time.perf_counter(); o3 = llm.generate([p], sp, use_tqdm=False)[0]; reload = time.perf_counter() - t
            rows.append(dict(cold=cold, hit=hit, reload=reload, cached=o3.num_cached_tokens,
                             same=o.outputs[0].token_ids == o2.outputs[0].token_ids == o3.outputs[0].token_ids,
                             toks=list(o.outputs[0].token_ids)))
            llm.reset_prefix_cache()
            p = TokensPrompt(prompt_token_ids=[t + 1 for t in p["prompt_token_ids"]])
        res[n] = rows
    print("RESULT", json.dumps(res))
    os._exit(0)
