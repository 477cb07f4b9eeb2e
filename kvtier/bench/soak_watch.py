"""The soak's resource watch: what a server's process tree holds, sampled every few seconds.

A :class:`Sample` per server per tick: RSS of the server and every descendant (bytes), their
open file descriptors and threads, the disk tier's bytes (kvtier only), the engine's KV block
usage (``vllm:kv_cache_usage_perc``), requests finished, and kvtier's own counters when the
server exports them (``vllm:kvtier_*``; absent ones stay None and are reported as n/a).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# (metric name, labels) per reported counter. vLLM's own are always there; kvtier's are optional.
VLLM_COUNTERS = {
    "requests_ok": ("vllm:request_success_total", {}),
    "prompt_tokens": ("vllm:prompt_tokens_total", {}),
    "tokens_computed": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "tokens_local_hit": ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
    "tokens_external": ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
}
KVTIER_COUNTERS = {
    "hit_tokens_cpu": ("vllm:kvtier_hit_tokens_total", {"tier": "cpu"}),
    "hit_tokens_disk": ("vllm:kvtier_hit_tokens_total", {"tier": "disk"}),
    "loaded_bytes": ("vllm:kvtier_loaded_bytes_total", {}),
    "saved_bytes": ("vllm:kvtier_saved_bytes_total", {}),
    "failed_loads": ("vllm:kvtier_failed_loads_total", {}),
    "dropped_saves": ("vllm:kvtier_dropped_saves_total", {}),
    "held_bytes_cpu": ("vllm:kvtier_held_bytes", {"tier": "cpu"}),
    "held_bytes_disk": ("vllm:kvtier_held_bytes", {"tier": "disk"}),
}


@dataclass
class Sample:
    t_s: float  # since the watch started
    rss_bytes: int
    fds: int  # open file descriptors, client connections to the server's HTTP port left out
    client_fds: int  # the clients' connections (keep-alive sockets come and go with the sessions)
    threads: int
    processes: int
    kv_usage: float  # fraction of the engine's KV blocks in use, 0-1
    running: float
    disk_bytes: int | None
    counters: dict = field(default_factory=dict)  # VLLM_COUNTERS and KVTIER_COUNTERS; None: not exported


def tree(pid: int):
    """The process ``pid`` and its descendants (psutil.Process), those still alive."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def take_sample(pid: int, url: str, disk: Path | None, t_s: float) -> Sample:
    import psutil

    from kvtier.bench.servers import metrics

    port = int(url.rsplit(":", 1)[1].split("/")[0])
    rss = fds = clients = threads = alive = 0
    for proc in tree(pid):
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                fds += proc.num_fds()
                threads += proc.num_threads()
                clients += sum(1 for c in proc.net_connections(kind="tcp") if c.laddr and c.laddr.port == port and c.raddr)
                alive += 1
        except psutil.NoSuchProcess:
            continue
    samples = metrics(url)

    def value(name: str, labels: dict) -> float | None:
        found = [v for n, have, v in samples if n == name and all(have.get(k) == w for k, w in labels.items())]
        return sum(found) if found else None

    counters = {key: value(*spec) for key, spec in {**VLLM_COUNTERS, **KVTIER_COUNTERS}.items()}
    disk_bytes = None if disk is None else sum(p.stat().st_size for p in disk.rglob("*.kv") if p.is_file())
    return Sample(t_s, rss, fds - clients, clients, threads, alive, value("vllm:kv_cache_usage_perc", {}) or 0.0,
                  value("vllm:num_requests_running", {}) or 0.0, disk_bytes, counters)


class Watch:
    """Samples each server (name -> (pid, url, disk dir or None)) every ``every_s`` on a thread."""

    def __init__(self, servers: dict, every_s: float, on_sample=None):
        self.servers, self.every_s, self.on_sample = servers, every_s, on_sample
        self.samples: dict[str, list[Sample]] = {name: [] for name in servers}
        self.errors: list[str] = []
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-watch", daemon=True)

    def begin(self) -> None:
        self._thread.start()

    def sample_now(self) -> dict[str, Sample]:
        now = {}
        for name, (pid, url, disk) in self.servers.items():
            try:
                now[name] = take_sample(pid, url, disk, time.monotonic() - self.start)
            except Exception as exc:  # noqa: BLE001 - a missed sample is reported, not fatal
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            self.samples[name].append(now[name])
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            now = self.sample_now()
            if self.on_sample is not None and now:
                self.on_sample(now)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def as_json(self) -> dict:
        return {name: [asdict(s) for s in samples] for name, samples in self.samples.items()}
