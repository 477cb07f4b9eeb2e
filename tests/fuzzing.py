"""What the fuzz tests share: a strategy that damages valid encodings, and one request over a
real ZMQ DEALER socket (CURVE to a chunk server with a secret)."""

from __future__ import annotations

import zmq
from hypothesis import strategies as st


@st.composite
def mutated(draw, base) -> bytes:
    """A valid encoding with a few bytes flipped, cut or inserted."""
    data = bytearray(draw(base))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


def ask(endpoint: str, frames: list[bytes], timeout_ms: int, secret: bytes | None = None) -> list[bytes] | None:
    """Send ``frames`` from a fresh DEALER socket (a CURVE client of a chunk server of ``secret``);
    the reply, or None after ``timeout_ms``."""
    from kvtier.pd.channel import secure_client

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    secure_client(socket, secret)
    socket.connect(endpoint)
    try:
        socket.send_multipart(frames)
        return socket.recv_multipart() if socket.poll(timeout_ms) else None
    finally:
        socket.close()
