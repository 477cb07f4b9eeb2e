"""The disk tier's reads: parallel parts on its own threads (O_DIRECT's block-aligned, or through
the page cache), and the chunks a load names in will_need read ahead into CPU pool buffers. Real
files; the O_DIRECT ones on a file system that takes O_DIRECT (``direct_dir``; skipped where none
does)."""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import threading
import time

import pytest
import torch

from kvtier.storage import ChunkStore, StoreConfig, Tier
from kvtier.storage import _ahead, _direct
from kvtier.storage import _lmcache as lm
from kvtier.storage._direct import CLOSED, NO_DIRECT, DirectReader

PART = 8192  # bytes per O_DIRECT request in these tests: a 64 KiB chunk is 8 parts
CHUNK = 64 * 1024 + 64  # bytes; a real chunk's 64-byte header leaves an unaligned tail
ALIGNED = 68 * 1024  # CHUNK rounded up to the pool's 4 KiB granule


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def payload(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


def aligned(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    buf = mmap.mmap(-1, max(nbytes, 1))  # page-aligned, as O_DIRECT needs
    return buf, memoryview(buf)[:nbytes]


def store_on(disk, chunks: int = 16) -> ChunkStore:
    store = ChunkStore(StoreConfig(cpu_bytes=chunks * ALIGNED, disk_path=str(disk), disk_bytes=64 * ALIGNED,
                                   o_direct=True))
    store._disk._reader.part_bytes = PART
    return store


def write_chunks(disk, count: int) -> None:
    """``count`` chunks written to ``disk`` by a store that is closed after: a restart's CPU tier is empty."""
    with store_on(disk) as store:
        for i in range(count):
            buf = store.allocate(CHUNK)
            buf.data.copy_(payload(i))
            store.put([key(i)], [buf])
        assert store._flush()


def path_of(store: ChunkStore, i: int) -> str:
    return store._disk.backend.dict[lm.engine_key(key(i), store._config)].path


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def gate(monkeypatch):
    """Every O_DIRECT part waits for ``gate.set()`` before it reads: reads stay in flight."""
    event = threading.Event()
    part = _direct._read_part

    def held(fd, view, offset):
        event.wait(10)
        return part(fd, view, offset)

    monkeypatch.setattr(_direct, "_read_part", held)
    yield event
    event.set()


@pytest.mark.parametrize("nbytes", [4096, 3 * PART, 3 * PART + 4096, 5 * PART + 64, 100],
                         ids=["one-block", "whole-parts", "part-and-a-block", "unaligned-tail", "tail-only"])
def test_parallel_parts_read_every_byte(direct_dir, nbytes):
    path = direct_dir / "f"
    data = os.urandom(nbytes)
    path.write_bytes(data)
    reader = DirectReader(threads=4, part_bytes=PART)
    buf, view = aligned(nbytes)
    try:
        assert reader.read(str(path), view) is None
        assert bytes(view) == data
    finally:
        reader.close()
        view.release()


def test_a_file_of_another_size_or_none_is_a_problem(direct_dir):
    path = direct_dir / "f"
    path.write_bytes(os.urandom(3 * PART))
    reader = DirectReader(threads=2, part_bytes=PART)
    buf, view = aligned(3 * PART + 64)
    try:
        assert reader.read(str(path), view) == f"{3 * PART} bytes on disk, {3 * PART + 64} expected"
        assert reader.read(str(direct_dir / "gone"), view) == "No such file or directory"
        assert reader.read(str(path), view[1 : 1 + PART]) == NO_DIRECT  # not aligned: read it another way
        reader.close()
        assert reader.read(str(path), view[: 3 * PART]) == CLOSED
    finally:
        reader.close()
        view.release()


def test_gets_read_chunks_in_parallel_parts(direct_dir):
    write_chunks(direct_dir, 3)
    with store_on(direct_dir) as store:
        for i in range(3):
            got = store.get(key(i))
            assert got is not None and got.tier is Tier.DISK
            assert torch.equal(got.data, payload(i))
            got.release()


def test_a_truncated_chunk_file_is_dropped_as_before(direct_dir, caplog):
    write_chunks(direct_dir, 2)
    with store_on(direct_dir) as store:
        path = path_of(store, 0)
        os.truncate(path, CHUNK - 4096)
        with caplog.at_level(logging.WARNING, logger="kvtier.storage"):
            assert store.get(key(0)) is None
        assert not os.path.exists(path) and store.contains(key(0)) is None
        assert sum("dropping disk chunk" in r.message for r in caplog.records) == 1
        assert store.get(key(1)) is not None  # its neighbour is untouched


def test_the_read_threads_end_with_the_store(direct_dir):
    write_chunks(direct_dir, 1)
    store = store_on(direct_dir)
    store.get(key(0)).release()
    reader = store._disk._reader
    assert any(t.name.startswith("kvtier-disk-read") for t in threading.enumerate())
    store.close()
    assert reader._pool is None
    assert not any(t.name.startswith("kvtier-disk-read") for t in threading.enumerate())


def test_will_need_reads_a_loads_chunks_ahead(direct_dir):
    write_chunks(direct_dir, 4)
    with store_on(direct_dir) as store:
        store.get(key(3)).release()  # in CPU: not read again
        store.will_need([key(i) for i in range(4)])
        ahead = store._disk._ahead
        assert ahead.held_bytes() == 3 * CHUNK
        for i in range(4):
            got = store.get(key(i))
            assert torch.equal(got.data, payload(i)) and got.tier is (Tier.CPU if i == 3 else Tier.DISK)
            got.release()
        assert ahead.held_bytes() == 0
        assert store.cpu_bytes_used() == 4 * ALIGNED  # the four promoted chunks, nothing else


def test_read_ahead_is_bounded_and_unclaimed_chunks_are_released(direct_dir, monkeypatch):
    write_chunks(direct_dir, 12)
    with store_on(direct_dir, chunks=40) as store:
        ahead = store._disk._ahead
        store.will_need([key(i) for i in range(12)])
        held = list(ahead._held.values())
        assert len(held) == _ahead.MAX_CHUNKS and ahead.held_bytes() <= ahead.max_bytes
        assert all(h.landed.wait(5) for h in held)
        assert store.cpu_bytes_used() == _ahead.MAX_CHUNKS * ALIGNED
        monkeypatch.setattr(_ahead, "STALE_S", 0.0)  # their load stopped: nobody claims them
        store.will_need([])
        assert ahead.held_bytes() == 0 and store.cpu_bytes_used() == 0


def test_a_chunk_removed_while_its_read_is_in_flight(direct_dir, gate):
    write_chunks(direct_dir, 2)
    with store_on(direct_dir) as store:
        store.will_need([key(0), key(1)])
        store.remove(key(0))  # its read is still in flight: the buffer stays until it lands
        assert store.contains(key(0)) is None
        gate.set()
        assert store.get(key(0)) is None
        got = store.get(key(1))
        assert torch.equal(got.data, payload(1))
        got.release()
        assert wait_for(lambda: store.cpu_bytes_used() == ALIGNED)  # chunk 1 in CPU; chunk 0's buffer back
        assert store._disk._ahead.held_bytes() == 0


def test_a_file_cut_short_during_its_read_ahead_is_dropped_once(direct_dir, gate, caplog):
    write_chunks(direct_dir, 2)
    with store_on(direct_dir) as store:
        path = path_of(store, 1)
        with caplog.at_level(logging.WARNING, logger="kvtier.storage"):
            store.will_need([key(0), key(1)])
            os.truncate(path, 2 * PART)  # after the size check, before the parts read
            gate.set()
            assert torch.equal(store.get(key(0)).data, payload(0))
            assert store.get(key(1)) is None
        assert sum("dropping disk chunk" in r.message for r in caplog.records) == 1
        assert not os.path.exists(path) and store.contains(key(1)) is None
        assert wait_for(lambda: store._disk._ahead.held_bytes() == 0)


def test_closing_with_reads_in_flight_leaks_no_buffer(direct_dir, gate):
    write_chunks(direct_dir, 4)
    store = store_on(direct_dir)
    try:
        store.will_need([key(i) for i in range(4)])
        assert store.cpu_bytes_used() == 4 * ALIGNED
        threading.Timer(0.2, gate.set).start()  # parts running when the close begins finish; the rest are cancelled
        store._sm.close_backend(lm.DISK_BACKEND)  # what close() does first: reads end, buffers go back
        assert store.cpu_bytes_used() == 0
    finally:
        store.close()


# ------------------------------------------------------------ through the page cache


@pytest.mark.parametrize("nbytes", [3 * PART, 5 * PART + 64, 100], ids=["whole-parts", "unaligned-tail", "tail-only"])
def test_buffered_parts_read_every_byte_into_any_buffer(tmp_path, nbytes):
    path = tmp_path / "f"
    data = os.urandom(nbytes)
    path.write_bytes(data)
    reader = DirectReader(threads=4, part_bytes=PART, direct=False)
    buf = bytearray(nbytes + 1)
    view = memoryview(buf)[1:]  # not page-aligned: O_DIRECT could not take it, the page cache can
    try:
        assert reader.read(str(path), view) is None
        assert bytes(view) == data
        assert reader.read(str(path), memoryview(bytearray(nbytes + 64))) == f"{nbytes} bytes on disk, {nbytes + 64} expected"
    finally:
        reader.close()
        view.release()


@pytest.fixture
def memory_dir():
    """An empty directory on a file system held in memory (``/dev/shm``); skips where there is none."""
    import shutil
    import tempfile

    if not os.path.isdir("/dev/shm") or not _direct.memory_backed("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    path = tempfile.mkdtemp(dir="/dev/shm", prefix="kvtier-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def buffered(disk) -> ChunkStore:
    return ChunkStore(StoreConfig(cpu_bytes=16 * ALIGNED, disk_path=str(disk), disk_bytes=64 * ALIGNED))


def write_buffered(disk, count: int) -> None:
    """``count`` chunks written through a buffered store that is closed after (a restart's CPU tier is empty)."""
    with buffered(disk) as store:
        for i in range(count):
            buf = store.allocate(CHUNK)
            buf.data.copy_(payload(i))
            store.put([key(i)], [buf])
        assert store._flush()


def test_a_buffered_tier_in_memory_reads_a_loads_chunks_ahead_in_parallel_parts(memory_dir):
    write_buffered(memory_dir, 3)
    with buffered(memory_dir) as store:  # a restart: the CPU tier is empty
        assert store._disk._reader.direct is False and store._disk._reader.part_bytes == _direct.PART_BYTES
        store.will_need([key(i) for i in range(3)])
        assert store._disk._ahead.held_bytes() == 3 * CHUNK
        for i in range(3):
            got = store.get(key(i))
            assert got.tier is Tier.DISK and torch.equal(got.data, payload(i))
            got.release()
        assert store._disk._ahead.held_bytes() == 0


def test_a_background_read_never_waits_behind_a_loads_reads(memory_dir):
    """A promotion's read (``background``) goes to the tier's second reader: with the load's reader
    stuck, it still lands, and both readers' threads end with the store."""
    write_buffered(memory_dir, 2)
    store = buffered(memory_dir)
    stuck, loads_reader = threading.Event(), store._disk._reader
    read = loads_reader.read
    loads_reader.read = lambda path, buf: (stuck.wait(10), read(path, buf))[1]
    got = []
    load = threading.Thread(target=lambda: got.append(store.get(key(0))))
    try:
        load.start()
        promoted = store.get(key(1), background=True)
        assert promoted.tier is Tier.DISK and torch.equal(promoted.data, payload(1)) and not got
        promoted.release()
        assert store.contains(key(1)) is Tier.CPU
    finally:
        stuck.set()
        load.join(10)
    assert got[0].tier is Tier.DISK and torch.equal(got[0].data, payload(0))
    got[0].release()
    background = store._disk._background
    store.close()
    assert loads_reader._pool is None and background._pool is None
    assert not any(t.name.startswith("kvtier-disk-read") for t in threading.enumerate())


def test_a_buffered_tier_on_a_disk_reads_each_file_whole_and_leaves_read_ahead_to_the_kernel(tmp_path):
    if _direct.memory_backed(str(tmp_path)):
        pytest.skip("the test directory is on a tmpfs here")
    with ChunkStore(StoreConfig(cpu_bytes=16 * ALIGNED, disk_path=str(tmp_path), disk_bytes=64 * ALIGNED)) as store:
        buf = store.allocate(CHUNK)
        buf.data.copy_(payload(0))
        store.put([key(0)], [buf])
        assert store._flush()
        assert store._disk._ahead is None and store._disk._reader.part_bytes == _direct.WHOLE_FILE
        store.will_need([key(0)])  # a WILLNEED hint, nothing held
    with ChunkStore(StoreConfig(cpu_bytes=16 * ALIGNED, disk_path=str(tmp_path), disk_bytes=64 * ALIGNED)) as store:
        got = store.get(key(0))
        assert got.tier is Tier.DISK and torch.equal(got.data, payload(0))
        got.release()


def test_where_o_direct_is_refused_the_tier_reads_through_the_page_cache_in_parts(tmp_path, monkeypatch, caplog):
    """A file system refusing O_DIRECT reads, stood in for (tmpfs before Linux 6.6 refused them, and
    this machine's does not): every part read through an O_DIRECT fd fails as the kernel would."""
    import fcntl

    part = _direct._read_part

    def refusing(fd, view, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            return NO_DIRECT
        return part(fd, view, offset)

    monkeypatch.setattr(_direct, "_read_part", refusing)
    config = dict(cpu_bytes=16 * ALIGNED, disk_path=str(tmp_path), disk_bytes=64 * ALIGNED, o_direct=True)
    with ChunkStore(StoreConfig(**config)) as store:
        for i in range(3):
            buf = store.allocate(CHUNK)
            buf.data.copy_(payload(i))
            store.put([key(i)], [buf])
        assert store._flush()
    with caplog.at_level(logging.WARNING), ChunkStore(StoreConfig(**config)) as store:
        got = store.get(key(0))  # refused, then read again through the page cache
        assert got.tier is Tier.DISK and torch.equal(got.data, payload(0))
        got.release()
        assert store._disk._reader.direct is False
        store.will_need([key(1), key(2)])  # read ahead again, buffered
        assert wait_for(lambda: store._disk._ahead.held_bytes() == 2 * CHUNK)
        for i in (1, 2):
            got = store.get(key(i))
            assert torch.equal(got.data, payload(i))
            got.release()
    assert caplog.text.count("O_DIRECT reads are not supported") == 1
