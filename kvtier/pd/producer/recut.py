"""A stored chunk re-cut to the token slots a consumer with another block size asks for."""

from __future__ import annotations

import logging

from kvtier import codec
from kvtier.pd.protocol import Fetch
from kvtier.storage import ChunkBuffer, ChunkStore

logger = logging.getLogger(__name__)


def recut(store: ChunkStore, buffer: ChunkBuffer, fetch: Fetch, token_bytes: tuple[int, ...]) -> ChunkBuffer | None:
    """``buffer``, or a copy of it (from ``store``) re-cut to the ``fetch.tokens`` token slots the
    consumer asks for: a prompt's partial tail, which each engine rounds up to its own block size.
    ``token_bytes``: bytes per token of each region (token-contiguous layouts only). Takes
    ``buffer``; None when there is no room or the chunk is corrupt."""
    try:
        stored = codec.read_header(buffer.data).tokens
    except codec.ChunkError:
        stored = fetch.tokens  # sent as it is: the consumer's check refuses it
    if stored == fetch.tokens:
        return buffer
    out = store.allocate(codec.HEADER_BYTES + fetch.tokens * sum(token_bytes), wait=False)
    try:
        if out is not None:
            codec.retoken(buffer.data, out.data, token_bytes, fetch.tokens)
    except codec.ChunkError as exc:
        logger.warning("kvtier P/D chunk server: chunk %d of transfer %s is unusable (%s); answered missing.",
                       fetch.index, fetch.transfer_id, exc)
        out.release()
        out = None
    finally:
        buffer.release()
    return out
