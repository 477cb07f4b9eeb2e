"""The disk tier's read speed, measured when a worker starts: from the chunk files a previous
store left (least recently used first) or a scratch file, bounded, through the loads' I/O path."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from kvtier.storage import ChunkStore, StoreConfig
from kvtier.storage._direct import memory_backed
from kvtier.storage._probe import SCRATCH_BYTES, measure_read_speed

CHUNK = 64 * 1024  # bytes per chunk (4 KiB-aligned)
POOL = 4 * CHUNK


def put_one(store: ChunkStore, i: int) -> None:
    buf = store.allocate(CHUNK)
    buf.data.copy_(torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
    store.put([hashlib.blake2b(str(i).encode(), digest_size=16).digest()], [buf])


def o_direct_works(directory: Path) -> bool:
    """Whether this file system lets O_DIRECT read a 4 KiB block (tmpfs, for one, refuses)."""
    path = directory / "odirect-check"
    path.write_bytes(b"\0" * 4096)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    buf = mmap.mmap(-1, 4096)
    try:
        return hasattr(os, "O_DIRECT") and os.readv(fd, [buf]) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()
        path.unlink()


def store_on(disk: Path, o_direct: bool = False) -> ChunkStore:
    return ChunkStore(StoreConfig(cpu_bytes=POOL, disk_path=str(disk), disk_bytes=64 * CHUNK, o_direct=o_direct))


def files(disk: Path) -> list[str]:
    return sorted(p.name for p in disk.iterdir())


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "direct"])
def test_a_restarted_tier_is_measured_on_its_own_chunk_files(tmp_path, o_direct):
    if o_direct and not o_direct_works(tmp_path):
        pytest.skip("O_DIRECT is refused on this file system")
    with store_on(tmp_path, o_direct) as store:
        for i in range(3):
            put_one(store, i)
        assert store._flush()
    before = files(tmp_path)
    with store_on(tmp_path, o_direct) as store:  # a restart: the CPU tier is empty, the files stay
        speed = store.disk_read_speed()
    assert speed is not None and speed.source == "chunks" and speed.direct is o_direct
    assert speed.files == 3 and speed.nbytes == 3 * CHUNK  # whole 4 KiB-aligned chunks, O_DIRECT too
    assert speed.bytes_per_s > 0 and "GB/s" in speed.describe()
    assert files(tmp_path) == before  # nothing written, nothing deleted


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "direct"])
def test_an_empty_tier_is_measured_on_a_scratch_file_it_deletes(tmp_path, o_direct):
    if o_direct and not o_direct_works(tmp_path):
        pytest.skip("O_DIRECT is refused on this file system")
    with store_on(tmp_path, o_direct) as store:
        speed = store.disk_read_speed()
    assert speed is not None and speed.source == "scratch" and speed.direct is o_direct
    assert 0 < speed.nbytes <= SCRATCH_BYTES
    assert files(tmp_path) == []


def test_the_read_is_bounded_in_bytes(tmp_path):
    paths = []
    for i in range(4):
        path = tmp_path / f"f{i}"
        path.write_bytes(os.urandom(1 << 20))
        paths.append(str(path))
    speed = measure_read_speed(str(tmp_path), paths, False, max_bytes=1536 << 10)
    assert speed.nbytes == 1536 << 10 and speed.files == 2  # one whole file, then half of the next


def test_the_read_is_bounded_in_time(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    assert measure_read_speed(str(tmp_path), [str(path)], False, max_s=0.0) is None  # no time: nothing read


def test_missing_files_and_an_unwritable_directory_measure_nothing(tmp_path):
    assert measure_read_speed(str(tmp_path), [str(tmp_path / "gone")], False) is None
    assert measure_read_speed(str(tmp_path / "no" / "such" / "dir"), [], False) is None


def test_no_disk_tier_no_speed():
    with ChunkStore(StoreConfig(cpu_bytes=POOL)) as store:
        assert store.disk_read_speed() is None


def test_a_tier_in_memory_is_said_to_be(tmp_path):
    """On a tmpfs the probe's figure understates reads that scale with cores: the speed says so."""
    if not os.path.isdir("/dev/shm") or not memory_backed("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    on_disk = measure_read_speed(str(tmp_path), [], False)
    if memory_backed(str(tmp_path)):
        pytest.skip("the test directory is on a tmpfs here")
    assert not on_disk.memory and "in memory" not in on_disk.describe()
    in_memory = tempfile.mkdtemp(dir="/dev/shm", prefix="kvtier-test-")
    try:
        speed = measure_read_speed(in_memory, [], False)
    finally:
        shutil.rmtree(in_memory, ignore_errors=True)
    assert speed.memory and "in memory" in speed.describe()
