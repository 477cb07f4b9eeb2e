"""vLLM's P/D request protocol (``kv_transfer_params``), as kvtier reads and answers it.

A proxy sends the prefill engine (P) ``{"do_remote_decode": true, ...}`` and copies what P's
``request_finished`` returns, unchanged, into the decode engine's (D) request: vLLM's standard
fields (``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
``remote_port``, ``tp_size``, and ``remote_block_ids``: P's engine blocks of the prompt, in
token order, where P lends them HBM to HBM) plus ``kvtier_endpoints``, every P rank's chunk
server, and with the block ids ``kvtier_lent_until``: when P's lease of them ends at the latest
(wall clock, s; D that asks later reads P's CPU tier without reading the blocks first). A proxy
that sends both legs at once gives both the same ``transfer_id`` (push): P publishes under it,
and D, which then may arrive before P has computed anything, waits for the chunks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

MAX_ID_CHARS = 256
MAX_BLOCK_IDS = 1 << 20  # a 16M-token prompt in 16-token blocks


@dataclass(frozen=True, slots=True)
class Produce:
    """A P request: publish the prompt under ``transfer_id`` (None: under the request id)."""

    transfer_id: str | None


@dataclass(frozen=True, slots=True)
class Consume:
    """A D request: fetch the prompt's KV published under ``transfer_id`` from ``endpoints``
    (one per P rank). ``wait``: P may not have computed it yet (both legs were sent at once).
    ``remote_blocks``: P's engine blocks of the prompt, in token order, as P named them (empty:
    not named): D may READ them before P's handshake reply confirms them (:mod:`kvtier.pd.consumer.landing`)."""

    transfer_id: str
    endpoints: tuple[str, ...]
    tp_size: int
    wait: bool
    remote_blocks: tuple[int, ...] = ()


def parse(params: dict[str, Any] | None) -> Produce | Consume | None:
    """The P/D role ``params`` give a request; None for a plain request or unusable parameters
    (logged once per request: D then recomputes, as it must whatever the proxy sent)."""
    if not isinstance(params, dict):
        return None
    transfer_id = params.get("transfer_id")
    if transfer_id is not None and not _is_id(transfer_id):
        logger.warning("kvtier P/D: ignoring kv_transfer_params with a bad transfer_id %r.", transfer_id)
        return None
    if params.get("do_remote_decode"):
        return Produce(transfer_id)
    if not params.get("do_remote_prefill"):
        return None
    rid = params.get("remote_request_id") or transfer_id
    endpoints = params.get("kvtier_endpoints")
    if endpoints is None and params.get("remote_host") and params.get("remote_port"):
        endpoints = [f"tcp://{params['remote_host']}:{params['remote_port']}"]
    tp_size = params.get("tp_size", 1)
    if not _is_id(rid) or not _are_endpoints(endpoints) or not isinstance(tp_size, int) or tp_size < 1:
        logger.warning("kvtier P/D: kv_transfer_params name no usable producer (remote_request_id %r, "
                       "endpoints %r, tp_size %r); recomputing the prompt.", rid, endpoints, tp_size)
        return None
    until = params.get("kvtier_lent_until")
    lent = not isinstance(until, (int, float)) or time.time() < until  # not said: lent, as far as D knows
    return Consume(rid, tuple(endpoints), tp_size, wait=transfer_id is not None,
                   remote_blocks=_block_ids(params.get("remote_block_ids")) if lent else ())


def role_in(params: dict[str, Any] | None, req_id: str) -> Produce | Consume | None:
    """:func:`parse`'s role for a request; None for a consumer whose params name another number of
    chunk servers than the producer's TP ranks (one line: the prompt is recomputed). A producer of
    another TP size than this engine's is read from all the same (:mod:`kvtier.pd.consumer.gather`)."""
    role = parse(params)
    if isinstance(role, Consume) and len(role.endpoints) != role.tp_size:
        logger.warning("kvtier P/D: request %s names %d chunk servers for a producer of %d TP ranks; "
                       "recomputing its prompt.", req_id, len(role.endpoints), role.tp_size)
        return None
    return role


def fetched_transfer(params: dict[str, Any] | None) -> str | None:
    """The producer's transfer a consumer request's ``params`` name, as given (for the timeline), else None."""
    params = params if isinstance(params, dict) else {}
    transfer = params.get("remote_request_id") or params.get("transfer_id") if params.get("do_remote_prefill") else None
    return transfer if isinstance(transfer, str) else None


def published(transfer_id: str, engine_id: str, endpoints: list[str], tp_size: int,
              block_ids: list[int] | None = None, lease_ms: int = 0) -> dict[str, Any]:
    """What P's ``request_finished`` returns: D's ``kv_transfer_params``; ``block_ids``: the
    request's engine blocks where P lends them for ``lease_ms`` from now (else None)."""
    head = urlsplit(endpoints[0].replace("tcp://", "http://", 1))
    lent = {"kvtier_lent_until": round(time.time() + lease_ms / 1000, 3)} if block_ids else {}
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": transfer_id,
        "remote_host": head.hostname,
        "remote_port": head.port,
        "remote_block_ids": list(block_ids) if block_ids else None,
        "tp_size": tp_size,
        "kvtier_endpoints": list(endpoints),
        **lent,
    }


def _is_id(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS


def _are_endpoints(value: object) -> bool:
    return (isinstance(value, list) and 0 < len(value) <= 1024
            and all(isinstance(e, str) and e.startswith("tcp://") and len(e) <= 512 for e in value))


def _block_ids(value: object) -> tuple[int, ...]:
    """Block ids as P named them (a list of ints, or one KV cache group's list in a list); empty
    where absent or malformed (D then waits for P's reply to name them, as without them)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if (isinstance(value, list) and 0 < len(value) <= MAX_BLOCK_IDS
            and all(type(b) is int and b >= 0 for b in value)):
        return tuple(value)
    return ()
