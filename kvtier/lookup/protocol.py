"""Lookup messages. Bump ``VERSION`` on any change; a peer speaking another version is refused.

Three messages travel to rank 0's server: a :class:`LookupRequest` from the scheduler (answered
with a :class:`LookupReply`), a :class:`HoldReport` from every worker rank and, once per rank,
its P/D chunk server's address in a :class:`PeerAddress` (neither answered). Keys are
16 bytes: chain keys in a request, a rank's storage keys in a report.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

VERSION = 6
MAX_MESSAGE_BYTES = 1 << 20  # 1 MiB: ~40k keys, a 10M-token prompt at 256 tokens a chunk
MAX_KEYS = 16384  # per message; reports are split to stay under it
KEY_BYTES = 16

Key = Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]
HeldTier = Literal["cpu", "disk", ""]  # "" : the rank no longer holds the chunk


class LookupRequest(msgspec.Struct, frozen=True, tag="lookup"):
    """Chain keys of a prompt's full chunks, in order."""

    version: int
    keys: Keys


class HoldReport(msgspec.Struct, frozen=True, tag="hold", omit_defaults=True):
    """What one worker rank holds now, for some of its storage keys.

    ``fingerprint``: the rank's layout fingerprint; its storage key of chain key ``k`` is
    ``kvtier.keys.storage_key(k, fingerprint)``. ``tiers[i]``: where ``keys[i]`` is now
    (``"cpu"``, ``"disk"``) or ``""`` when the rank lost it (evicted, removed, never stored).
    ``base`` and ``heads`` (``[first, end, total]``): when the rank's chunks are pieces keyed by the
    KV heads they hold (:mod:`kvtier.shards`), its layout's TP-independent fingerprint and heads,
    so that rank 0 also counts a chunk whose pieces another TP size stored; else empty.
    """

    version: int
    rank: Annotated[int, msgspec.Meta(ge=0)]
    world_size: Annotated[int, msgspec.Meta(ge=1)]
    fingerprint: Key
    keys: Keys
    tiers: Annotated[list[HeldTier], msgspec.Meta(max_length=MAX_KEYS)]
    base: Annotated[bytes, msgspec.Meta(max_length=KEY_BYTES)] = b""
    heads: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=3)] = []


class PeerAddress(msgspec.Struct, frozen=True, tag="peer"):
    """Rank ``rank`` serves its chunks to P/D decode engines at ``endpoint`` (``tcp://host:port``)."""

    version: int
    rank: Annotated[int, msgspec.Meta(ge=0)]
    world_size: Annotated[int, msgspec.Meta(ge=1)]
    endpoint: Annotated[str, msgspec.Meta(max_length=512)]


class LookupReply(msgspec.Struct, frozen=True):
    """Tier of each leading chunk every rank holds (``"disk"`` if any rank has it on disk only),
    then ``"shared"`` for each next chunk the shared tier holds for every rank; stops at the first
    chunk some rank lacks.

    ``chunk_load_ms``: measured milliseconds to load one chunk from each tier on rank 0 (fetch,
    verify and copy into engine blocks; a tier appears once it has been measured). ``error`` is
    set, and ``tiers`` empty, when the request was refused. ``endpoints``: every rank's P/D
    chunk server, in rank order, once all ranks have told theirs (else empty). ``probed``: the
    tiers of ``chunk_load_ms`` whose figure started from the tier's read speed, measured when
    rank 0 started (the disk tier's), and is refined by loads since: a figure the scheduler may
    veto a load on before it has measured loads of its own.
    """

    version: int
    tiers: list[str]
    error: str = ""
    chunk_load_ms: dict[str, float] = {}
    endpoints: list[str] = []
    probed: list[str] = []


encode = msgspec.msgpack.Encoder().encode
decode_message = msgspec.msgpack.Decoder(Union[LookupRequest, HoldReport, PeerAddress]).decode
decode_reply = msgspec.msgpack.Decoder(LookupReply).decode
