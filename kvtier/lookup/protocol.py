"""Lookup messages. Bump ``VERSION`` on any change; a peer speaking another version is refused."""

from __future__ import annotations

import msgspec

VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20  # 1 MiB: ~65k chunk keys, a 16M-token prompt at 256 tokens a chunk


class LookupRequest(msgspec.Struct, frozen=True):
    """Chain keys of a prompt's full chunks, in order (16 bytes each)."""

    version: int
    keys: list[bytes]


class LookupReply(msgspec.Struct, frozen=True):
    """Tier of each leading stored chunk (``"cpu"`` or ``"disk"``); stops at the first miss.

    ``error`` is set, and ``tiers`` empty, when the request was refused.
    """

    version: int
    tiers: list[str]
    error: str = ""


encode = msgspec.msgpack.Encoder().encode
decode_request = msgspec.msgpack.Decoder(LookupRequest).decode
decode_reply = msgspec.msgpack.Decoder(LookupReply).decode
