"""Keep a producer's NIXL agent while its chunk server is up; drop it the moment the server goes.

A consumer that READs a producer's engine blocks holds that producer's GPU memory open for as
long as it knows the producer's agent (UCX opens a peer's memory handles when it unpacks its
remote keys and closes them only when the agent is removed), so a producer restarted on the same
GPU would find its old KV cache still held. Dropping an agent unused for a few seconds frees it,
but the next transfer after such a pause adds the agent again, inside that transfer's handshake
(on the 2-core CI machine with host memory only: a pull's handshake 18 ms instead of 1, its first
READ 31 ms instead of 0.2; more where P registers more regions).

So an agent a fetch reached (:meth:`Agent.connect` with the producer's chunk server endpoint) is
kept however idle, and watched here instead: one idle ZMQ connection to that server, with ZMQ
heartbeats, on this module's thread (CURVE with a secret, as every connection to a chunk
server: :mod:`kvtier.pd.channel`). When it ends (the producer exited or stopped answering
heartbeats) or cannot be made, the agent is dropped at once (:meth:`Agent.forget`).
"""

from __future__ import annotations

import logging
import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtier.pd.channel import secure_client
from kvtier.pd.nixl import Agent

logger = logging.getLogger(__name__)

HEARTBEAT_MS = 1000  # ZMQ heartbeats on an idle watch connection
HEARTBEAT_TIMEOUT_MS = 5000  # a server that answers none of them this long counts as gone
_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED


class _Watched:
    """One producer's watch connection: its socket, the socket's monitor, the producer's chunk
    server, whether the connection came up (``secret``: the P/D secret, for CURVE)."""

    def __init__(self, context: zmq.Context, endpoint: str, secret: bytes | None):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        secure_client(self.socket, secret)
        self.monitor = self.socket.get_monitor_socket(_EVENTS)
        self.socket.connect(endpoint)
        self.endpoint = endpoint
        self.up = False

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)


class PeerWatch:
    """Watches the chunk servers of ``agent``'s peers, looking every ``interval_s`` for new ones
    (``secret``: the P/D secret those servers share, None: none)."""

    def __init__(self, agent: Agent, interval_s: float = 0.1, secret: bytes | None = None):
        self._agent = agent
        self._secret = secret
        self._interval_ms = max(1, int(interval_s * 1000))
        self._stop = threading.Event()
        self.dropped = 0  # peers dropped because their chunk server went away
        self._thread = threading.Thread(target=self._run, name="kvtier-peer-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        context = zmq.Context.instance()
        watched: dict[str, _Watched] = {}  # peer name -> its watch (sockets used by this thread only)
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                endpoints = self._agent.endpoints()
                for name in [n for n in watched if n not in endpoints]:  # forgotten elsewhere (failed, idle)
                    poller.unregister(watched[name].monitor)
                    watched.pop(name).close()
                for name, endpoint in endpoints.items():
                    if name not in watched:
                        watched[name] = _Watched(context, endpoint, self._secret)
                        poller.register(watched[name].monitor, zmq.POLLIN)
                if not watched:  # (an empty poll might not wait)
                    self._stop.wait(self._interval_ms / 1000)
                    continue
                ready = dict(poller.poll(self._interval_ms))
                for name, watch in list(watched.items()):
                    if watch.monitor in ready and self._gone(name, watch):
                        poller.unregister(watch.monitor)
                        watched.pop(name).close()
                        self._agent.forget(name=name)
                        self.dropped += 1
        finally:
            for watch in watched.values():
                watch.close()

    def _gone(self, name: str, watch: _Watched) -> bool:
        """Read the monitor's events; True once the connection ended (or never came up)."""
        while watch.monitor.poll(0):
            event = recv_monitor_message(watch.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                watch.up = True
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) or (
                    event == zmq.EVENT_CONNECT_RETRIED and not watch.up):
                logger.info("kvtier P/D: producer %s's chunk server went away; its NIXL agent %s is dropped "
                            "(nothing of its memory stays held here).", watch.endpoint, name)
                return True
        return False
