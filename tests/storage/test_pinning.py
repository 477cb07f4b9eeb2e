"""The CPU tier's pool pinned in parallel slices (kvtier.storage.pinning).

This machine has no GPU: ``cudaHostRegister`` is replaced by a recorder here (the test says
where), and everything else is real: the anonymous mapping, the threads faulting the slices in,
LMCache's StorageManager allocating its pool through kvtier's allocator, chunks stored in it."""

from __future__ import annotations

import logging
import re
import threading

import pytest
import torch

from kvtier.storage import ChunkStore, StoreConfig, pinning

MiB = 1 << 20


class Registrations:
    """Stands in for cudaHostRegister / cudaHostUnregister (no GPU here)."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.registered: dict[int, int] = {}
        self.lock = threading.Lock()

    def register(self, address: int, nbytes: int) -> None:
        with self.lock:
            if self.fail_at is not None and len(self.registered) == self.fail_at:
                raise RuntimeError("cudaHostRegister failed: out of memory")
            self.registered[address] = nbytes

    def unregister(self, address: int) -> None:
        with self.lock:
            del self.registered[address]


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(pinning, "SLICE_BYTES", MiB)


@pytest.fixture
def small_registrations(monkeypatch):
    monkeypatch.setattr(pinning, "REGISTER_BYTES", 4 * MiB)


def test_the_pool_is_faulted_in_on_several_threads_and_registered_in_large_ranges(small_slices, small_registrations,
                                                                                  monkeypatch):
    faulting: set[str] = set()
    fault_in = pinning._fault_in
    monkeypatch.setattr(pinning, "_fault_in", lambda a, n: (faulting.add(threading.current_thread().name),
                                                            fault_in(a, n)))
    cuda = Registrations()
    pool = pinning.allocate(8 * MiB + 4096, cuda.register, cuda.unregister, threads=4)
    assert pool.numel() == 8 * MiB + 4096 and not pool.any()
    base = pool.data_ptr()
    # one registration per 4 MiB here (64 GiB on a GPU host): an async copy never crosses two
    assert sorted(cuda.registered.items()) == [(base, 4 * MiB), (base + 4 * MiB, 4 * MiB), (base + 8 * MiB, 4096)]
    assert len(faulting) > 1
    pool[:] = 7  # usable memory
    assert pinning.free(pool) and cuda.registered == {}
    assert not pinning.free(pool)  # freed once


def test_a_registration_that_fails_undoes_the_others_and_raises(small_slices, small_registrations):
    cuda = Registrations(fail_at=1)
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        pinning.allocate(8 * MiB, cuda.register, cuda.unregister, threads=1)
    assert cuda.registered == {}


def test_lmcache_allocates_its_pool_through_kvtier_on_a_cuda_host(small_slices, monkeypatch, caplog):
    import lmcache.v1.memory_management as lm

    cuda = Registrations()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no GPU here: the registration is
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the recorder above
    monkeypatch.setattr(pinning, "cuda_register", lambda device: (cuda.register, cuda.unregister))
    monkeypatch.setattr(pinning, "_installed", False)
    monkeypatch.setattr(lm, "_allocate_cpu_memory", lm._allocate_cpu_memory)  # restored after the test
    monkeypatch.setattr(lm, "_free_cpu_memory", lm._free_cpu_memory)
    caplog.set_level(logging.INFO, logger="kvtier.storage.pinning")
    with ChunkStore(StoreConfig(cpu_bytes=16 * MiB)) as store:
        assert sum(cuda.registered.values()) >= 16 * MiB  # the whole pool, in slices
        said = [r.getMessage() for r in caplog.records if "pinned in" in r.getMessage()]
        assert len(said) == 1 and re.search(r"GiB pinned in [\d.]+ s, \d+% of it in transparent huge pages\.$", said[0])
        buffer = store.allocate(MiB)
        buffer.data[:] = 3
        store.put([b"k" * 16], [buffer])
        got = store.get(b"k" * 16)
        assert got is not None and bool((got.data == 3).all())
        got.release()
    assert cuda.registered == {}  # closing the store unregistered the pool


def test_the_share_of_a_pool_in_huge_pages_comes_from_its_mappings_in_smaps(small_slices, tmp_path):
    pool = pinning.allocate(8 * MiB)
    start = pool.data_ptr()
    try:
        real = pinning.huge_share(pool)  # this process's own smaps
        assert real is not None and 0.0 <= real <= 1.0
        smaps = tmp_path / "smaps"  # the pool in two mappings (4 MiB huge in all), beside another one
        smaps.write_text(f"{start - 8 * MiB:x}-{start:x} rw-p 00000000 00:00 0\nAnonHugePages:      8192 kB\n"
                         f"{start:x}-{start + 4 * MiB:x} rw-p 00000000 00:00 0\nRss:  4096 kB\n"
                         f"AnonHugePages:      2048 kB\n"
                         f"{start + 4 * MiB:x}-{start + 8 * MiB:x} rw-p 00000000 00:00 0\nAnonHugePages:      2048 kB\n"
                         f"{start + 8 * MiB:x}-{start + 16 * MiB:x} r--p 00000000 08:01 42 /lib/x.so\n"
                         f"AnonHugePages:      4096 kB\n")
        assert pinning.huge_share(pool, str(smaps)) == 0.5
        assert pinning.huge_share(pool, str(tmp_path / "none")) is None  # unreadable: not said
        assert pinning.huge_share(torch.zeros(16, dtype=torch.uint8)) is None  # not a pool of ours
    finally:
        assert pinning.free(pool)


def test_the_pool_may_prefer_a_numa_node():
    assert pinning.prefer_node(0, 0, 64) is False  # no such node bit
    pool = pinning.allocate(4 * MiB, node=0)  # this host's one node: mbind takes it
    assert not pool.any()
    buf = pinning.allocate(MiB)
    assert pinning.prefer_node(buf.data_ptr(), MiB, 0) in (True, False)  # never raises
    for tensor in (pool, buf):
        assert pinning.free(tensor)


def test_the_gpus_numa_node_comes_from_sysfs_where_there_are_several(tmp_path, monkeypatch):
    from types import SimpleNamespace

    sysfs = tmp_path
    (sysfs / "devices/system/node/node0").mkdir(parents=True)
    device_dir = sysfs / "bus/pci/devices/0000:1b:00.0"
    device_dir.mkdir(parents=True)
    (device_dir / "numa_node").write_text("1\n")
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)  # no GPU here
    assert pinning.gpu_numa_node(0, str(sysfs)) is None  # one node: nothing to choose
    (sysfs / "devices/system/node/node1").mkdir()
    assert pinning.gpu_numa_node(0, str(sysfs)) == 1
    (device_dir / "numa_node").write_text("-1\n")  # the firmware does not say
    assert pinning.gpu_numa_node(0, str(sysfs)) is None
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace())  # an older torch
    assert pinning.gpu_numa_node(0, str(sysfs)) is None
