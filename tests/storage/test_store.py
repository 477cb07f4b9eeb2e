"""ChunkStore against the real LMCache 0.5.6 (no mocks), with real files under tmp_path."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from kvtier.storage import ChunkBuffer, ChunkStore, StorageError, StoreConfig, Tier

CHUNK = 64 * 1024  # bytes; a multiple of the pool's 4 KiB alignment, so POOL holds exactly 4
POOL = 4 * CHUNK
REPO = Path(__file__).resolve().parents[2]


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def payload(i: int, nbytes: int = CHUNK) -> torch.Tensor:
    gen = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


@pytest.fixture
def open_store():
    """Factory for stores that are always closed, even when a test fails."""
    stores: list[ChunkStore] = []

    def make(cpu_bytes: int = POOL, disk: Path | None = None, disk_bytes: int = 64 * CHUNK, **kw):
        cfg = StoreConfig(
            cpu_bytes=cpu_bytes,
            disk_path=None if disk is None else str(disk),
            disk_bytes=disk_bytes if disk is not None else 0,
            **kw,
        )
        store = ChunkStore(cfg)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def put_one(store: ChunkStore, i: int, nbytes: int = CHUNK) -> torch.Tensor:
    buf = store.allocate(nbytes)
    assert buf is not None, f"allocate failed for chunk {i}"
    data = payload(i, nbytes)
    buf.data.copy_(data)
    store.put([key(i)], [buf])
    return data


def read(store: ChunkStore, i: int) -> tuple[Tier, torch.Tensor] | None:
    buf = store.get(key(i))
    if buf is None:
        return None
    try:
        return buf.tier, buf.data.clone()
    finally:
        buf.release()


def chunk_files(disk: Path) -> list[Path]:
    return sorted(p for p in disk.iterdir() if p.name.endswith(".kv"))


# ---------------------------------------------------------------- CPU tier


def test_round_trip_through_cpu(open_store):
    store = open_store()
    data = put_one(store, 1, nbytes=CHUNK - 123)  # not a multiple of anything
    assert store.contains(key(1)) is Tier.CPU
    buf = store.get(key(1))
    assert isinstance(buf, ChunkBuffer) and buf.tier is Tier.CPU
    assert buf.data.dtype == torch.uint8 and buf.data.dim() == 1
    assert torch.equal(buf.data, data)
    buf.release()
    buf.release()  # idempotent
    assert store.get(key(2)) is None and store.contains(key(2)) is None


def test_eviction_without_disk(open_store):
    store = open_store()
    for i in range(10):
        put_one(store, i)
    assert [store.contains(key(i)) for i in range(10)] == [None] * 6 + [Tier.CPU] * 4
    assert store.prefix_hits([key(i) for i in range(10)]) == []
    assert store.prefix_hits([key(i) for i in range(6, 10)]) == [Tier.CPU] * 4
    assert store.prefix_hits([key(i) for i in (6, 7, 0, 8)]) == [Tier.CPU] * 2
    assert store.get(key(0)) is None
    assert store.cpu_bytes_used() == POOL


def test_lru_refreshed_on_hit(open_store):
    store = open_store()
    a, b, c, d, e = range(5)
    for i in (a, b, c, d):
        put_one(store, i)
    assert read(store, a)[0] is Tier.CPU  # touches A: B is now least recently used
    put_one(store, e)
    assert store.contains(key(b)) is None
    assert [store.contains(key(i)) for i in (a, c, d, e)] == [Tier.CPU] * 4


def test_allocate_larger_than_pool_returns_none_without_evicting(open_store):
    store = open_store()
    put_one(store, 1)
    assert store.allocate(POOL + 1) is None
    assert store.contains(key(1)) is Tier.CPU
    whole = store.allocate(POOL)  # exactly the pool: evicts chunk 1 to fit
    assert whole is not None and whole.data.numel() == POOL
    assert store.contains(key(1)) is None
    assert store.allocate(CHUNK) is None  # nothing left to evict: held buffer pins the pool
    whole.release()
    assert store.cpu_bytes_used() == 0


def test_put_existing_key_releases_new_buffer(open_store):
    store = open_store()
    first = put_one(store, 1)
    dup = store.allocate(CHUNK)
    dup.data.fill_(7)
    again = store.allocate(CHUNK)
    again.data.fill_(9)
    store.put([key(1), key(2), key(2)], [dup, again, store.allocate(CHUNK)])
    assert dup.released and again.released
    assert torch.equal(read(store, 1)[1], first)  # the original bytes, not the duplicate
    assert torch.equal(read(store, 2)[1], torch.full((CHUNK,), 9, dtype=torch.uint8))
    assert store.cpu_bytes_used() == 2 * CHUNK


def test_put_rejects_bad_buffers_before_taking_any(open_store):
    store, other = open_store(), open_store()
    mine, foreign = store.allocate(CHUNK), other.allocate(CHUNK)
    with pytest.raises(ValueError):
        store.put([key(1), key(2)], [mine, foreign])
    with pytest.raises(ValueError):
        store.put([key(1)], [mine, mine])
    assert not mine.released and not foreign.released
    mine.release()
    foreign.release()
    with pytest.raises(ValueError):
        store.put([key(1)], [mine])


def test_no_leaks(open_store):
    store = open_store()
    assert store.cpu_bytes_used() == 0
    held = [store.allocate(CHUNK) for _ in range(2)]
    assert store.cpu_bytes_used() == 2 * CHUNK
    for buf in held:
        buf.release()
    assert store.cpu_bytes_used() == 0
    for i in range(3):
        put_one(store, i)
    used = store.cpu_bytes_used()
    assert used == 3 * CHUNK
    bufs = [store.get(key(i)) for i in range(3)]
    assert store.cpu_bytes_used() == used  # a CPU hit shares the cached chunk, no copy
    for buf in bufs:
        buf.release()
    for i in range(3):
        store.remove(key(i))
    assert store.cpu_bytes_used() == 0


def test_close_releases_everything_and_is_idempotent(open_store):
    store = open_store()
    put_one(store, 1)
    held = store.get(key(1))
    fresh = store.allocate(CHUNK)
    store.close()
    store.close()
    assert store.cpu_bytes_used() == 0
    assert held.released and fresh.released and held.data.numel() == 0
    held.release()  # still a no-op
    with pytest.raises(RuntimeError):
        store.contains(key(1))


# ---------------------------------------------------------------- disk tier


def test_eviction_with_disk_comes_back_and_is_promoted(open_store, tmp_path):
    disk = tmp_path / "disk"
    store = open_store(disk=disk)
    datas = {i: put_one(store, i) for i in range(10)}
    assert store._flush()
    tiers = [store.contains(key(i)) for i in range(10)]
    assert tiers == [Tier.DISK] * 6 + [Tier.CPU] * 4  # LRU order holds with writes in flight
    assert len(chunk_files(disk)) == 10  # write-through: every chunk is on disk
    assert store.prefix_hits([key(i) for i in range(10)]) == tiers
    assert store.prefix_hits([key(6), key(0), key(7), key(42), key(8)]) == [
        Tier.CPU, Tier.DISK, Tier.CPU
    ]
    for i in (0, 3, 5):
        tier, data = read(store, i)
        assert tier is Tier.DISK and torch.equal(data, datas[i])
        assert store.contains(key(i)) is Tier.CPU  # promoted
        tier, data = read(store, i)
        assert tier is Tier.CPU and torch.equal(data, datas[i])
    assert store.cpu_bytes_used() == POOL


def test_a_cpu_only_put_writes_nothing_to_disk(open_store, tmp_path):
    disk = tmp_path / "disk"
    store = open_store(disk=disk)
    buf = store.allocate(CHUNK)
    buf.data.copy_(payload(1))
    store.put([key(1)], [buf], cpu_only=True)
    put_one(store, 2)
    assert store._flush()
    assert len(chunk_files(disk)) == 1  # only chunk 2 was written through
    assert store.contains(key(1)) is Tier.CPU and torch.equal(read(store, 1)[1], payload(1))


def test_restart_restores_disk_tier(open_store, tmp_path):
    disk = tmp_path / "disk"
    with ChunkStore(StoreConfig(cpu_bytes=POOL, disk_path=str(disk), disk_bytes=64 * CHUNK)) as s:
        datas = {i: put_one(s, i) for i in range(6)}
    store = open_store(disk=disk)
    for i, data in datas.items():
        assert store.contains(key(i)) is Tier.DISK
        tier, got = read(store, i)
        assert tier is Tier.DISK and torch.equal(got, data)
    assert store.contains(key(99)) is None


def test_restart_deletes_truncated_file(open_store, tmp_path, caplog):
    disk = tmp_path / "disk"
    with ChunkStore(StoreConfig(cpu_bytes=POOL, disk_path=str(disk), disk_bytes=64 * CHUNK)) as s:
        put_one(s, 1)
        put_one(s, 2)
    victim = next(p for p in chunk_files(disk) if key(1).hex() in p.name)
    survivor = next(p for p in chunk_files(disk) if key(2).hex() in p.name)
    with open(victim, "r+b") as f:
        f.truncate(CHUNK // 2)
    caplog.set_level(logging.WARNING, logger="kvtier.storage")
    store = open_store(disk=disk)
    assert not victim.exists() and survivor.exists()
    assert store.contains(key(1)) is None and store.contains(key(2)) is Tier.DISK
    assert any("deleting disk chunk" in r.getMessage() for r in caplog.records)


def test_restart_ignores_other_namespaces_and_workers(open_store, tmp_path):
    disk = tmp_path / "disk"
    cfg = dict(cpu_bytes=POOL, disk_path=str(disk), disk_bytes=64 * CHUNK)
    with ChunkStore(StoreConfig(namespace="other", **cfg)) as s:
        put_one(s, 1)
    with ChunkStore(StoreConfig(worker_id=1, world_size=2, **cfg)) as s:
        put_one(s, 2)
    (disk / "notes.txt").write_text("not a chunk")
    store = open_store(disk=disk)
    assert store.contains(key(1)) is None and store.contains(key(2)) is None
    assert len(chunk_files(disk)) == 2 and (disk / "notes.txt").exists()


def test_remove_drops_cpu_and_disk(open_store, tmp_path):
    disk = tmp_path / "disk"
    store = open_store(disk=disk)
    put_one(store, 1)
    put_one(store, 2)
    assert store._flush() and len(chunk_files(disk)) == 2
    store.remove(key(1))
    assert store.contains(key(1)) is None and store.get(key(1)) is None
    assert len(chunk_files(disk)) == 1 and store.contains(key(2)) is Tier.CPU
    store.remove(key(1))  # absent: no-op
    put_one(store, 1)  # the key can be stored again, on disk too
    assert store._flush() and len(chunk_files(disk)) == 2


def test_vanished_or_truncated_file_at_get_returns_none(open_store, tmp_path):
    disk = tmp_path / "disk"
    store = open_store(disk=disk)
    for i in range(6):
        put_one(store, i)
    assert store._flush()
    assert store.contains(key(0)) is Tier.DISK and store.contains(key(1)) is Tier.DISK
    path0, path1 = (next(p for p in chunk_files(disk) if key(i).hex() in p.name) for i in (0, 1))
    path0.unlink()
    with open(path1, "r+b") as f:
        f.truncate(100)
    used = store.cpu_bytes_used()
    assert store.get(key(0)) is None and store.get(key(1)) is None
    assert store.contains(key(0)) is None and store.contains(key(1)) is None
    assert not path1.exists()
    assert store.cpu_bytes_used() == used


def test_disk_write_failure_keeps_cpu_copy_and_logs_once(open_store, tmp_path, caplog):
    disk = tmp_path / "disk"
    store = open_store(disk=disk)
    disk.rmdir()  # every write now fails with ENOENT
    caplog.set_level(logging.WARNING, logger="kvtier.storage")
    data = put_one(store, 1)
    assert store._flush()
    failures = [r for r in caplog.records if "disk write failed" in r.getMessage()]
    assert len(failures) == 1
    assert store.contains(key(1)) is Tier.CPU
    assert torch.equal(read(store, 1)[1], data)
    # The failed write gave its reference back: the chunk is evictable again.
    for i in range(2, 6):
        put_one(store, i)
    assert store.contains(key(1)) is None


def test_chunk_too_big_for_disk_stays_in_cpu(open_store, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kvtier.storage")
    store = open_store(disk=tmp_path / "disk", disk_bytes=CHUNK // 2)
    data = put_one(store, 1)
    assert store._flush()
    assert store.contains(key(1)) is Tier.CPU and torch.equal(read(store, 1)[1], data)
    assert not chunk_files(tmp_path / "disk")
    assert sum("larger than disk_bytes" in r.getMessage() for r in caplog.records) == 1


def test_concurrent_use_keeps_bytes_and_accounting_straight(open_store, tmp_path):
    disk = tmp_path / "disk"
    store = open_store(cpu_bytes=6 * CHUNK, disk=disk, disk_bytes=12 * CHUNK)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = torch.Generator().manual_seed(seed)
        try:
            for _ in range(250):
                i, op = (int(v) for v in torch.randint(0, 30, (2,), generator=rng))
                if op < 13:
                    buf = store.allocate(CHUNK)
                    if buf is not None:
                        buf.data.fill_(i)
                        store.put([key(i)], [buf])
                elif op < 27:
                    buf = store.get(key(i))
                    if buf is not None:
                        ok = bool((buf.data == i).all())
                        buf.release()
                        assert ok, f"chunk {i} came back with other bytes"
                elif op < 29:
                    store.remove(key(i))
                else:
                    store.prefix_hits([key(j) for j in range(i)])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors[0]
    assert store._flush()
    in_cpu = sum(store.contains(key(i)) is Tier.CPU for i in range(30))
    assert store.cpu_bytes_used() == in_cpu * CHUNK
    indexed = store._disk.backend.dict
    assert len(chunk_files(disk)) == len(indexed)
    assert store._disk.backend.current_cache_size == len(indexed) * CHUNK
    store.close()
    assert store.cpu_bytes_used() == 0


# ---------------------------------------------------------------- config and lifecycle


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(cpu_bytes=0), "cpu_bytes"),
        (dict(cpu_bytes=-5), "cpu_bytes"),
        (dict(cpu_bytes=POOL, disk_path="DISK", disk_bytes=0), "disk_bytes"),
        (dict(cpu_bytes=POOL, namespace="a@b"), "namespace"),
        (dict(cpu_bytes=POOL, worker_id=2, world_size=2), "worker_id"),
    ],
)
def test_config_errors_name_the_field(kwargs, field, tmp_path):
    if kwargs.get("disk_path") == "DISK":
        kwargs["disk_path"] = str(tmp_path / "d")
    with pytest.raises(StorageError, match=field):
        StoreConfig(**kwargs)


def test_unwritable_disk_path_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad = str(blocker / "sub")  # a directory cannot be created under a regular file
    with pytest.raises(StorageError, match=f"disk_path '{bad}' is not writable"):
        ChunkStore(StoreConfig(cpu_bytes=POOL, disk_path=bad, disk_bytes=POOL))
    created = tmp_path / "new" / "dir"
    ChunkStore(StoreConfig(cpu_bytes=POOL, disk_path=str(created), disk_bytes=POOL)).close()
    assert created.is_dir()


def test_process_exits_and_keys_map_identically_across_processes(open_store, tmp_path):
    disk = tmp_path / "disk"
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from kvtier.storage import ChunkStore, StoreConfig
        from test_store import key, put_one
        store = ChunkStore(StoreConfig(cpu_bytes={POOL}, disk_path={str(disk)!r},
                                       disk_bytes={64 * CHUNK}))
        put_one(store, 7)
        held = store.get(key(7))  # deliberately not released: close() must cope
        store.close()
        store.close()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    store = open_store(disk=disk)
    assert store.contains(key(7)) is Tier.DISK
    assert torch.equal(read(store, 7)[1], payload(7))


def test_a_store_leaves_the_environment_as_it_found_it(open_store, monkeypatch):
    # LMCache sets PROMETHEUS_MULTIPROC_DIR for itself; a vLLM server started later by this
    # process would otherwise sum its /metrics with every process's files in that directory.
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    open_store()
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/somewhere/chosen")
    open_store()
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == "/somewhere/chosen"


def test_will_need_looks_up_nothing_without_a_disk_tier(open_store, tmp_path):
    asked: list[bytes] = []

    def keys():
        for i in range(3):
            asked.append(key(i))
            yield key(i)

    open_store().will_need(keys())
    assert asked == []  # a load's read-ahead costs a CPU-only store no lookups
    open_store(disk=tmp_path).will_need(keys())
    assert len(asked) == 3
