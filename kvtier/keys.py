"""Chunk keys: a prefix hash chain over token ids, the same in every process.

``key[i] = blake3(key[i-1] || tokens of chunk i as int64 little-endian)`` with ``key[-1]`` the
namespace digest of (model, cache_salt). The worker mixes in the layout fingerprint when it
stores a chunk (:func:`storage_key`), so a key made under one layout never loads into another.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import blake3
import numpy as np

KEY_BYTES = 16
# blake3 lets go of the interpreter for an update of 2,048 bytes or more. Keys are made on the
# engine's thread: each time it takes the interpreter back it may wait for another thread's turn
# (one hash of a chunk's 2 KiB of token ids took ~2 ms beside a thread running Python, against
# ~2 us alone). Fed in smaller updates, a hash never lets go; the digest is the same.
_UPDATE_BYTES = 2047


def _hash(data: bytes) -> bytes:
    """The 16-byte blake3 digest of ``data``, hashed without letting go of the interpreter."""
    hasher, view = blake3.blake3(), memoryview(data)
    for at in range(0, len(view), _UPDATE_BYTES):
        hasher.update(view[at : at + _UPDATE_BYTES])
    return hasher.digest(KEY_BYTES)


def namespace(model: str, cache_salt: str | None = None) -> bytes:
    """Root of the chain: chunks of different models or salts never share a key."""
    text = f"kvtier-keys-v1\x00{model}\x00{cache_salt or ''}"
    return blake3.blake3(text.encode()).digest(KEY_BYTES)


def chunk_keys(token_ids: Sequence[int], chunk_tokens: int, root: bytes, known: Sequence[bytes] = ()) -> list[bytes]:
    """One key per *full* chunk of ``token_ids`` (a trailing partial chunk gets none).

    ``known``: the keys of the first chunks, already made: only the chunks after them are hashed
    (a request's reply extends its prompt's chain a chunk at a time)."""
    first = len(known) * chunk_tokens
    count = max(0, len(token_ids) - first)
    # one conversion of the list, no copy of it first: 17 % of a 32k prompt's keys (made on arrival)
    tokens = np.fromiter(itertools.islice(token_ids, first, None), dtype="<i8", count=count).tobytes()
    keys, prev, step = list(known), (known[-1] if known else root), chunk_tokens * 8
    for start in range(0, len(tokens) - step + 1, step):
        prev = _hash(prev + tokens[start : start + step])
        keys.append(prev)
    return keys


def tail_key(token_ids: Sequence[int], chunk_tokens: int, root: bytes, keys: Sequence[bytes]) -> bytes | None:
    """Key of the trailing partial chunk of ``token_ids`` (None when there is none).

    ``keys``: the full chunks' keys from :func:`chunk_keys`. Marked so that it can never equal
    the key of a full chunk (a P/D producer publishes the whole prompt, tail included).
    """
    start = len(keys) * chunk_tokens
    if start >= len(token_ids):
        return None
    tail = np.asarray(token_ids[start:], dtype="<i8").tobytes()
    return _hash((keys[-1] if keys else root) + b"tail" + tail)


def storage_key(key: bytes, fingerprint: bytes) -> bytes:
    """The key a chunk is stored under on a worker: chain key bound to the worker's layout."""
    return blake3.blake3(key + fingerprint).digest(KEY_BYTES)


def group_key(key: bytes, group: int) -> bytes:
    """Chain key of a chunk's blocks in KV cache group ``group`` of a hybrid model; ``group`` 0
    is the anchor group (:mod:`kvtier.engines.vllm.groups`), whose chunks keep ``key`` itself."""
    return key if group == 0 else blake3.blake3(key + b"group" + group.to_bytes(4, "little")).digest(KEY_BYTES)
