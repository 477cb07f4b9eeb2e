"""kvtier's tiers as vLLM KV cache events: ``BlockStored`` / ``BlockRemoved`` with medium ``CPU``
or ``DISK``, so that a KV-aware router subscribed to vLLM's event publisher sees which prefixes
this engine can reload, not only those in its GPU blocks.

A chunk is announced with the engine's own names for its blocks (:class:`kvtier.jobs.ChunkBlocks`:
vLLM's block hashes, parent hash, tokens, extra keys), carried from the scheduler to the workers
with the chunk's save, so a router matches them against vLLM's own ``GPU`` events for the same
tokens. One event covers a whole chunk (``chunk_tokens / block_size`` hashes); a chunk that leaves
a tier is removed with the same hashes. Only rank 0 announces (every rank holds the same chunks).
Chunks this engine did not save in its lifetime (kept on disk by an earlier run, fetched from a
P/D producer) carry no names and are not announced.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Iterable

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash

from kvtier.engines.vllm.compat import to_event_extra_keys
from kvtier.jobs import ChunkBlocks

# kvtier.storage.Tier value -> event medium. (kvtier.storage itself is not imported: it loads
# LMCache, which the scheduler process and a worker's early start-up must not.)
MEDIUM = {"cpu": "CPU", "disk": "DISK"}
MAX_UNSTORED = 1 << 16  # named chunks whose save has not landed (or was dropped); the oldest are forgotten


def name_chunk(request, chunk: int, chunk_blocks: int, block_size: int) -> ChunkBlocks | None:
    """vLLM's names for chunk ``chunk`` of ``request`` (a ``vllm.v1.request.Request``); None if
    the request has no block hashes that far."""
    first, end = chunk * chunk_blocks, (chunk + 1) * chunk_blocks
    hashes = request.block_hashes[first:end]
    if len(hashes) < chunk_blocks:
        return None
    extra = [generate_block_hash_extra_keys(request, b * block_size, (b + 1) * block_size, 0)[0]
             for b in range(first, end)]
    event_keys = to_event_extra_keys(extra) if any(k is not None for k in extra) else None
    return ChunkBlocks(
        hashes=tuple(bytes(h) for h in hashes),
        parent=bytes(request.block_hashes[first - 1]) if first else None,
        token_ids=tuple(request.all_token_ids[first * block_size : end * block_size]),
        block_size=block_size,
        extra_keys=None if event_keys is None else tuple(event_keys),
    )


class TierEvents:
    """Turns changes of a store's chunks into events. ``residency(key)``: the tiers holding a
    storage key now. :meth:`name` and :meth:`changed` may be called from any thread (``changed``
    from under a tier's lock: it only records); :meth:`take` from one thread."""

    def __init__(self, residency: Callable[[bytes], tuple]):
        self._residency = residency
        self._lock = threading.Lock()
        self._names: dict[bytes, ChunkBlocks] = {}
        self._where: dict[bytes, frozenset[str]] = {}  # tiers announced for each named key
        self._unstored: OrderedDict[bytes, None] = OrderedDict()
        self._dirty: set[bytes] = set()

    def name(self, key: bytes, blocks: ChunkBlocks) -> None:
        with self._lock:
            self._names[key] = blocks
            if key not in self._where:
                self._unstored[key] = None
                if len(self._unstored) > MAX_UNSTORED:
                    self._names.pop(self._unstored.popitem(last=False)[0], None)
            self._dirty.add(key)

    def changed(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._dirty.update(keys)

    def take(self) -> list[KVCacheEvent]:
        """Events for every named chunk whose tiers changed since the last call."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        events: list[KVCacheEvent] = []
        for key in dirty:
            blocks = self._names.get(key)
            if blocks is None:
                continue
            now = frozenset(t.value for t in self._residency(key) if t.value in MEDIUM)
            before = self._where.get(key, frozenset())
            events += [_stored(blocks, tier) for tier in sorted(now - before, key=list(MEDIUM).index)]
            events += [BlockRemoved(block_hashes=_hashes(blocks), medium=MEDIUM[tier])
                       for tier in sorted(before - now, key=list(MEDIUM).index)]
            with self._lock:
                if now:
                    self._where[key] = now
                    self._unstored.pop(key, None)
                elif before:  # gone from every tier
                    self._where.pop(key, None)
                    self._names.pop(key, None)
        return events


class KvtierKVEvents(KVConnectorKVEvents):
    """The events of a step, as vLLM carries them from the workers to the scheduler.
    ``settling``: more are on their way (saves still landing), so the engine should keep stepping
    even when idle, or a router would not hear of them until the next request."""

    def __init__(self, events: Iterable[KVCacheEvent] = (), num_workers: int = 1, settling: bool = False):
        self._events = list(events)
        self._workers = num_workers
        self.settling = settling

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events += events

    def aggregate(self) -> KvtierKVEvents:
        return self  # only rank 0 announces: nothing to reconcile across workers

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._events

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []


def _hashes(blocks: ChunkBlocks) -> list:
    return [maybe_convert_block_hash(h) for h in blocks.hashes]


def _stored(blocks: ChunkBlocks, tier: str) -> BlockStored:
    return BlockStored(
        block_hashes=_hashes(blocks),
        parent_block_hash=None if blocks.parent is None else maybe_convert_block_hash(blocks.parent),
        token_ids=list(blocks.token_ids),
        block_size=blocks.block_size,
        lora_id=None,
        medium=MEDIUM[tier],
        lora_name=None,
        extra_keys=None if blocks.extra_keys is None else list(blocks.extra_keys),
        group_idx=0,
    )
