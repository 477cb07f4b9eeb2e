"""The P/D side channel's ZMQ sockets: a chunk server's ROUTER, a transfer's DEALER, a watch's.

With a shared secret they speak ZMQ CURVE: every message and ZMQ payload frame between a decode
engine and a chunk server is encrypted (NIXL's data plane is not: it moves the bytes itself).
The chunk server's key pair is derived from the secret (:func:`server_keys`), so a decode engine
that knows the secret knows the server's public key without another setting; each client socket
makes a fresh key pair of its own. A peer without the server's public key cannot even finish
ZMQ's handshake: the server counts and logs those (:class:`HandshakeFailures`); the peer hears
nothing. The MACs of :mod:`kvtier.pd.protocol` still authenticate every message: CURVE
here keeps the handshake's NIXL metadata and the chunks off the wire in clear text. Without
CURVE in this pyzmq's libzmq, one line says so and the channel goes unencrypted.
"""

from __future__ import annotations

import logging

import blake3
import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)
_KEY_CONTEXT = "kvtier P/D chunk server CURVE secret key v1"  # BLAKE3 key derivation context
_said: list[bool] = []  # the missing CURVE was logged
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def curve() -> bool:
    """Whether this libzmq has CURVE (logs once when it has not)."""
    if zmq.has("curve"):
        return True
    if not _said:
        _said.append(True)
        logger.warning("kvtier P/D: this pyzmq's libzmq has no CURVE; the P/D side channel is authenticated "
                       "(pd_secret) but not encrypted.")
    return False


def server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The chunk server's CURVE ``(public, secret)`` keys (Z85, 40 bytes each), derived from the
    shared ``secret`` with BLAKE3's key derivation."""
    secret_key = z85.encode(blake3.blake3(secret, derive_key_context=_KEY_CONTEXT).digest(32))
    return zmq.curve_public(secret_key), secret_key


def bind_router(bind: str, secret: bytes | None, max_bytes: int, send_hwm: int) -> tuple[zmq.Socket, int]:
    """A chunk server's ROUTER bound at ``bind`` (``tcp://host:port``, port 0 for a free one) and
    its port; messages over ``max_bytes`` are dropped unread, ``send_hwm`` replies queued per peer."""
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer fails, not blocks
    socket.setsockopt(zmq.SNDHWM, send_hwm)
    if secret is not None and curve():
        socket.curve_publickey, socket.curve_secretkey = server_keys(secret)
        socket.curve_server = True
    if bind.endswith(":0"):
        return socket, socket.bind_to_random_port(bind[: bind.rindex(":")])
    socket.bind(bind)
    return socket, int(bind.rsplit(":", 1)[1])


def secure_client(socket: zmq.Socket, secret: bytes | None) -> None:
    """Make ``socket`` (not connected yet) a CURVE client of a chunk server of ``secret`` (None: as it is)."""
    if secret is not None and curve():
        socket.curve_serverkey = server_keys(secret)[0]
        socket.curve_publickey, socket.curve_secretkey = zmq.curve_keypair()


def connect_dealer(endpoint: str, secret: bytes | None, max_bytes: int) -> zmq.Socket:
    """A fresh DEALER connected to the chunk server at ``endpoint`` (one per transfer); replies
    over ``max_bytes`` are dropped. The caller closes it."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 200)
    socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    secure_client(socket, secret)
    socket.connect(endpoint)
    return socket


class HandshakeFailures:
    """The peers of a CURVE server ``socket`` that failed ZMQ's handshake (another secret, or
    none): counted, the first logged and then one line per ``log_every``. Used by the socket's
    thread only; nothing to count on a socket without CURVE."""

    def __init__(self, socket: zmq.Socket, log_every: int):
        self._socket, self._log_every, self.total = socket, log_every, 0
        self._monitor = socket.get_monitor_socket(_FAILED) if socket.curve_server else None

    def take(self) -> int:
        """Failures since the last call."""
        count = 0
        while self._monitor is not None and self._monitor.poll(0):
            recv_monitor_message(self._monitor)
            count += 1
            if (self.total + count) % self._log_every == 1:
                logger.warning("kvtier P/D chunk server: a peer failed the encrypted (CURVE) handshake: it has "
                               "another pd_secret, or none; %d so far.", self.total + count)
        self.total += count
        return count

    def close(self) -> None:
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor.close(0)
