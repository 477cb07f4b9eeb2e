"""NIXL for one engine rank, brought up in the background (UCX takes ~2 s to start): the agent,
its CPU pool and engine KV registered, the chunk server told. Until it is up, and wherever it
failed, P/D chunks go over ZMQ; the start-up line says which."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvtier.config import ConfigError
from kvtier.pd import nixl
from kvtier.pd.engine_kv import EngineKv
from kvtier.pd.consumer.peer_watch import PeerWatch
from kvtier.pd.producer.server import ChunkServer

logger = logging.getLogger(__name__)


class NixlStart:
    """Starts the agent for rank ``rank``. ``pool``: ``(address, bytes)`` of the CPU tier's pool.
    ``engine_kv``: this rank's engine KV (None: a hybrid model's; it stays unregistered).
    ``chunk_server``: this rank's (None on a consumer). ``on_landing``: called once consumers
    may READ into the engine KV. ``secret``: the P/D secret (the watch of producers' chunk servers
    speaks CURVE with it)."""

    def __init__(self, rank: int, pool: tuple[int, int], engine_kv: EngineKv | None,
                 chunk_server: ChunkServer | None, on_landing: Callable[[], None], secret: bytes | None = None):
        self.rank = rank
        self.pool = pool
        self.engine_kv = engine_kv
        self.chunk_server = chunk_server
        self.on_landing = on_landing
        self.secret = secret
        self.agent: nixl.Agent | None = None
        self.watch: PeerWatch | None = None  # the chunk servers of the producers this rank fetched from
        self._thread: threading.Thread | None = None

    def start(self, transport: str) -> str:
        """Start unless ``transport`` is ``zmq``; the start-up line's words for the transport.
        Raises ConfigError when ``nixl`` is required but not installed."""
        if transport == "zmq":
            return "; P/D chunks over ZMQ"
        if not nixl.available():
            if transport == "nixl":
                raise ConfigError("kvtier setting 'pd_transport' is 'nixl', but NIXL is not installed here "
                                  "(pip install nixl-cu12, or nixl on CUDA hosts).")
            return "; P/D chunks over ZMQ (NIXL is not installed)"
        self._thread = threading.Thread(target=self._run, name="kvtier-nixl-start", daemon=True)
        self._thread.start()
        return "; P/D chunks over NIXL where the peer has it (starting), else ZMQ"

    def _run(self) -> None:
        engine_kv = self.engine_kv
        device = engine_kv.device if engine_kv is not None and engine_kv.kind == "VRAM" else None
        begin = time.perf_counter()
        try:
            agent = nixl.make_agent(device)
            agent.bind_device()  # UCX finds cuda_ipc only from a thread with the device set
            agent.register([self.pool])
        except Exception as exc:  # UCX could not start: ZMQ carries every transfer
            logger.warning("kvtier P/D: NIXL did not start (%s); chunks go over ZMQ.", exc)
            return
        hbm = "no engine KV registered (hybrid model: chunks go through the CPU tier)"
        if engine_kv is not None:
            try:
                hbm = engine_kv.register(agent)
                self.on_landing()
            except Exception as exc:  # e.g. a UCX without CUDA support: the CPU-tier path stays
                hbm = f"engine KV not registered ({exc}): P/D chunks go through the CPU tiers"
        self.watch = PeerWatch(agent, secret=self.secret)
        self.agent = agent
        if self.chunk_server is not None:
            self.chunk_server.engine = engine_kv.engine_blocks() if engine_kv is not None else None
            self.chunk_server.nixl = agent
        logger.info("kvtier rank %d: NIXL agent %s up in %.1f s (in the background), %.1f GiB of CPU pool "
                    "registered (UCX, no progress thread); %s; %s.", self.rank, agent.name, time.perf_counter() - begin,
                    self.pool[1] / (1 << 30), hbm, nixl.gpu_mapping())

    def ready(self, timeout_s: float = 30.0) -> bool:
        """Wait until NIXL is up (True), or is not to be used here (False)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.agent is not None

    def close(self) -> None:
        """Deregister the CPU pool and stop the agent (after the engine KV's own close)."""
        if self._thread is not None:
            self._thread.join(30)
        if self.watch is not None:
            self.watch.close()
        if self.agent is not None:
            self.agent.deregister([self.pool])
            self.agent.close()
            self.agent = None
