"""A decode engine's side of the handshake with a producer's chunk server: each hello it sends
(a fresh nonce and send time, :func:`introduce`), the fetches a pull's hello carries, and the
reply it accepts (:func:`check_reply`: the nonce of the hello it answers, the same layout, engine
KV regions that can be; :mod:`kvtier.pd.protocol`)."""

from __future__ import annotations

import logging
import os
import time

import msgspec

from kvtier.pd.hbm import Landing, RegionSpan, judged, region_problem
from kvtier.pd.route import Route
from kvtier.pd.protocol import (
    BATCH_BYTES, MAX_HELLO_FETCHES, NONCE_BYTES, VERSION, Fetch, Hello, HelloReply, encode, layout_problem,
)

logger = logging.getLogger(__name__)
_warned: set[str] = set()  # producers whose layout mismatch was logged
_told: set[tuple[str, str]] = set()  # (producer, transport) pairs logged


class PeerError(RuntimeError):
    """The producer could not deliver: unreachable, timed out, refused, mismatched or missing."""


def new_nonce() -> bytes:
    """A hello's nonce: :data:`~kvtier.pd.protocol.NONCE_BYTES` random bytes, never reused."""
    return os.urandom(NONCE_BYTES)


def introduce(hello: Hello, **fields) -> Hello:
    """``hello`` with ``fields`` replaced, sent now: with a fresh nonce unless ``fields`` give one."""
    fields.setdefault("nonce", new_nonce())
    return msgspec.structs.replace(hello, **fields, sent_ms=time.time_ns() // 1_000_000)


def push_hello(hello: Hello, metadata: bytes, landing: Landing | None) -> Hello:
    """The second hello of a push D may be written into: this engine's NIXL ``metadata`` and, with
    a ``landing``, its engine KV regions (a fresh nonce)."""
    regions = () if landing is None else tuple((r.base, r.stride, r.block_bytes) for r in landing.regions)
    return introduce(hello, nixl=metadata, regions=regions, device=landing.device if landing is not None else 0)


def first_fetches(transfer_id: str, items: list[tuple[bytes, int]], landing: Landing,
                  block_size: int, nonce: bytes, endpoint: str) -> tuple[Fetch, ...]:
    """A pull's first fetches, to go with its hello of ``nonce``: those of transfer ``transfer_id``'s
    ``items`` (each chunk's ``(chain key, block count)``) that fit :data:`~kvtier.pd.protocol.BATCH_BYTES`,
    each asking for P's engine blocks where the chunk lands in this engine's (``landing``);
    ``block_size``: this engine's, in tokens. None before the HBM path to the producer at
    ``endpoint`` was judged (the first transfer probes it before it asks for anything)."""
    if not judged(endpoint, landing.kind):
        return ()
    fetches, size = [], 0
    for i, (key, n) in enumerate(items[:MAX_HELLO_FETCHES]):
        fetch = Fetch(VERSION, transfer_id, i, key, n, tokens=n * block_size, hbm=landing.block_ids[i] is not None,
                      nonce=nonce)
        size += len(encode(fetch))
        if size > BATCH_BYTES:
            break
        fetches.append(fetch)
    return tuple(fetches)


def check_reply(endpoint: str, hello: Hello, reply: HelloReply) -> None:
    """Refuse (:class:`PeerError`) a handshake reply to another hello than ``hello`` (a replay),
    engine KV regions that cannot be, or a producer whose chunks mean other bytes than this
    engine's (one line per producer)."""
    if reply.nonce != hello.nonce:
        raise PeerError(f"{endpoint} answered another hello than this engine's (a replayed or stale reply)")
    if problem := region_problem(tuple(RegionSpan(*r) for r in reply.regions), reply.num_blocks):
        raise PeerError(f"{endpoint} lends engine KV that cannot be: {problem}")
    problem = reply.error or layout_problem(hello, reply)
    if problem:
        if endpoint not in _warned:
            _warned.add(endpoint)
            logger.warning("kvtier P/D: not loading from %s (%s); recomputing.", endpoint, problem)
        raise PeerError(problem)


def silence(endpoint: str, timeout_ms: int, unanswered_secure_hello: bool) -> str:
    """Why a producer is given up after ``timeout_ms`` of silence, in words; with
    ``unanswered_secure_hello`` (a secret is set and no handshake reply came) with what it may be:
    a chunk server of another secret never finishes ZMQ's CURVE handshake, and says nothing."""
    why = f"{endpoint} sent nothing for {timeout_ms} ms"
    maybe = " (its pd_secret may differ: its encrypted channel then never opens)" if unanswered_secure_hello else ""
    return why + maybe


def say_transport(endpoint: str, route: Route) -> None:
    """One line per producer and transport: how its chunks come on ``route``."""
    how = ("NIXL (HBM to HBM while the producer holds the blocks, else into this engine's CPU tier)"
           if route.hbm else "NIXL (UCX, into this engine's CPU tier)" if route.nixl else "ZMQ")
    if (endpoint, how) not in _told:
        _told.add((endpoint, how))
        logger.info("kvtier P/D: fetching from %s over %s.", endpoint, how)
