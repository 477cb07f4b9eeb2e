"""``kvtier-bench pd-soak``'s forged messages: what a peer that knows the P/D secret but took part
in no transfer can send a producer's chunk server (its address: P's ``kvtier_endpoints``).

Nothing is captured: every message is built here with :mod:`kvtier.pd.protocol`'s structs and
MAC, so it follows that protocol as it changes, and each goes out on a DEALER connection of its
own (:func:`kvtier.pd.channel.connect_dealer`: CURVE with the secret), as a new peer would send it. Per forged transfer:

- a ``Release`` of a transfer still in flight (another connection's), asking for an answer;
- a ``Hello`` as a decode engine sends it (the producer's own layout fingerprint, learnt from a
  first probe hello to that producer), then the very same frames again on another connection:
  the replay.

Each message's outcome is what the producer answered within the wait: ``refused`` (a
``refused`` reply), ``answered`` (a handshake reply, or ``released``: the release was obeyed),
``silent`` (nothing), or ``unreadable`` (a reply that did not authenticate or decode).
"""

from __future__ import annotations

OUTCOMES = ("refused", "answered", "silent", "unreadable")
_fingerprints: dict[str, bytes] = {}  # producer endpoint -> its layout fingerprint (from a probe hello)


def _exchange(endpoint: str, frames: list[bytes], secret: bytes | None, wait_s: float) -> tuple[str, object]:
    """Send ``frames`` ([mac, body]) on a new DEALER to ``endpoint``; (outcome, reply or None)."""
    import zmq

    from kvtier.pd import protocol
    from kvtier.pd.channel import connect_dealer

    sock = connect_dealer(endpoint, secret, 1 << 20)  # CURVE with the secret, as a decode engine's
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.send_multipart(frames)
        if not sock.poll(int(wait_s * 1000), zmq.POLLIN):
            return "silent", None
        try:
            reply = protocol.read_reply(sock.recv_multipart(copy=False), secret, lent_unchecked=False)
        except ValueError:  # a wrong MAC (AuthError), another version, bad msgpack
            return "unreadable", None
    finally:
        sock.close()
    if isinstance(reply, protocol.ChunkReply) and reply.status == "refused":
        return "refused", reply
    return "answered", reply


def _frames(message, secret: bytes | None) -> list[bytes]:
    from kvtier.pd import protocol

    body = protocol.encode(message)
    return [protocol.mac(secret, body), body]


def _hello(fingerprint: bytes, chunk_tokens: int, transfer_id: str):
    """A hello as a decode engine sends it: a fresh nonce, sent now."""
    from kvtier.pd import protocol
    from kvtier.pd.consumer.hello import introduce

    return introduce(protocol.Hello(version=protocol.VERSION, rank=0, tp_size=1, fingerprint=fingerprint,
                                    layout="kvtier-bench pd-soak forged hello", chunk_tokens=chunk_tokens,
                                    transports=("nixl", "zmq"), hbm=True, transfer_id=transfer_id))


def fingerprint(endpoint: str, secret: bytes | None, chunk_tokens: int, wait_s: float) -> bytes:
    """The producer's layout fingerprint, from a probe hello's reply (cached per endpoint); 16
    zero bytes when the probe got none."""
    if endpoint not in _fingerprints:
        outcome, reply = _exchange(endpoint, _frames(_hello(bytes(16), chunk_tokens, ""), secret), secret, wait_s)
        got = getattr(reply, "fingerprint", b"") if outcome == "answered" else b""
        if len(got) != 16:
            return bytes(16)
        _fingerprints[endpoint] = got
    return _fingerprints[endpoint]


def forge(endpoint: str, secret: bytes | None, transfer_id: str, chunk_tokens: int, wait_s: float) -> dict[str, str]:
    """Send the forged ``Release`` of ``transfer_id`` and the replayed ``Hello`` to ``endpoint``;
    their outcomes, ``{"release": …, "hello_replay": …}`` (and ``"hello"``: the replayed
    hello's first sending). ``chunk_tokens``: the servers' ``chunk_tokens``; ``wait_s``: how
    long each message waits for its answer, s. Any failure to build or send is ``unreadable``."""
    from kvtier.pd import protocol

    out = {}
    try:
        release = protocol.Release(version=protocol.VERSION, transfer_id=transfer_id, answer=True)
        out["release"] = _exchange(endpoint, _frames(release, secret), secret, wait_s)[0]
        frames = _frames(_hello(fingerprint(endpoint, secret, chunk_tokens, wait_s), chunk_tokens, transfer_id), secret)
        out["hello"] = _exchange(endpoint, frames, secret, wait_s)[0]
        out["hello_replay"] = _exchange(endpoint, frames, secret, wait_s)[0]
    except Exception as exc:  # noqa: BLE001 - the protocol changed shape, or ZMQ failed: counted, the soak goes on
        out.setdefault("error", f"{type(exc).__name__}: {exc}")
    for name in ("release", "hello", "hello_replay"):
        out.setdefault(name, "unreadable")
    return out
