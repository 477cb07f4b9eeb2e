"""KV cache events for kvtier's tiers, from a real ChunkStore (CPU pool + disk tier): stored,
written to disk, evicted, removed, each announced once with the chunk's vLLM names."""

from __future__ import annotations

import hashlib

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from kvtier.engines.vllm.events import TierEvents  # noqa: E402
from kvtier.jobs import ChunkBlocks  # noqa: E402
from kvtier.storage import ChunkStore, StoreConfig  # noqa: E402

CHUNK = 64 * 1024  # bytes: the pool holds exactly 4


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def names(i: int) -> ChunkBlocks:
    hashes = tuple(hashlib.sha256(f"{i}/{b}".encode()).digest() for b in range(2))
    return ChunkBlocks(hashes, hashlib.sha256(f"{i - 1}/1".encode()).digest() if i else None,
                       tuple(range(i * 64, i * 64 + 64)), 32, (("salt",), None) if i == 0 else None)


@pytest.fixture
def store(tmp_path):
    store = ChunkStore(StoreConfig(cpu_bytes=4 * CHUNK, disk_path=str(tmp_path), disk_bytes=64 * CHUNK))
    yield store
    store.close()


def put(store: ChunkStore, events: TierEvents, i: int) -> None:
    buf = store.allocate(CHUNK)
    buf.data.fill_(i)
    store.put([key(i)], [buf])
    events.changed([key(i)])  # what the save executor's on_held does


def summary(events) -> list[tuple[str, str, tuple]]:
    return [(type(e).__name__, e.medium, tuple(e.block_hashes)) for e in events]


def hashes(i: int) -> tuple:
    return tuple(maybe_convert_block_hash(h) for h in names(i).hashes)


def test_a_chunk_is_announced_in_each_tier_it_enters_and_leaves(store):
    events = TierEvents(store.residency)
    store.watch(events.changed)
    events.name(key(0), names(0))
    assert events.take() == []  # named at save time; not stored yet
    put(store, events, 0)
    assert store._flush()
    got = events.take()
    assert sorted(summary(got)) == [("BlockStored", "CPU", hashes(0)), ("BlockStored", "DISK", hashes(0))]
    stored = got[0]
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None and stored.block_size == 32
    assert stored.token_ids == list(range(64)) and stored.extra_keys == [("salt",), None]
    assert events.take() == []  # nothing changed since: nothing announced again

    # Four more chunks evict chunk 0 from the CPU pool; its disk copy stays.
    for i in range(1, 5):
        events.name(key(i), names(i))
        put(store, events, i)
        assert store._flush()
    got = summary(events.take())
    assert ("BlockRemoved", "CPU", hashes(0)) in got and ("BlockRemoved", "DISK", hashes(0)) not in got
    assert [g for g in got if g[0] == "BlockStored" and g[2] == hashes(0)] == []
    assert {g[2] for g in got if g == ("BlockStored", "CPU", g[2])} == {hashes(i) for i in range(1, 5)}

    store.remove(key(0))  # gone from disk too: removed with the same hashes, then forgotten
    assert summary(events.take()) == [("BlockRemoved", "DISK", hashes(0))]
    put(store, events, 0)  # stored again without names: not announced (it evicts chunk 1 from CPU)
    assert summary(events.take()) == [("BlockRemoved", "CPU", hashes(1))]


def test_chunks_without_names_are_never_announced(store):
    events = TierEvents(store.residency)
    store.watch(events.changed)
    put(store, events, 7)
    assert store._flush()
    store.remove(key(7))
    assert events.take() == []
