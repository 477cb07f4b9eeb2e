"""The background promoter on its own, over a stub store: it waits for loads and saves, reads a
chunk only while it is still on disk only, reads as many chunks at once as it has readers, and past
its bound lets a newer submission displace the oldest one's last keys, dropping what finds no room."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.storage import DiskSpeed, Tier
from kvtier.transfer.promote import Promoter, beside_loads


class StubStore:
    def __init__(self, disk):
        self.tiers = {k: Tier.DISK for k in disk}
        self.reads = []

    def contains(self, key):
        return self.tiers.get(key)

    def get(self, key, background=False):
        assert background  # promotions read on the disk tier's second reader
        self.reads.append(key)
        self.tiers[key] = Tier.CPU
        store = self

        class Buf:
            def release(self):
                store.released = getattr(store, "released", 0) + 1
        return Buf()


def test_promotes_only_disk_chunks_and_only_when_idle():
    store, busy = StubStore([b"a", b"b"]), threading.Event()
    busy.set()
    promoter = Promoter(store, chunk_bytes=100, max_bytes=1000, busy=busy.is_set)
    try:
        assert promoter.submit([b"a", b"a", b"b", b"gone"]) == 3  # a key queued twice counts once
        time.sleep(0.05)
        assert store.reads == []  # a load or save runs: nothing is read
        busy.clear()
        assert promoter.wait_idle(10)
        assert store.reads == [b"a", b"b"] and store.released == 2 and promoter.promoted == 2
    finally:
        promoter.close()


def test_keys_past_the_bound_are_dropped():
    store, busy = StubStore([bytes([i]) for i in range(10)]), threading.Event()
    busy.set()
    promoter = Promoter(store, chunk_bytes=100, max_bytes=300, busy=busy.is_set)  # three chunks at most
    try:
        assert promoter.submit([bytes([i]) for i in range(10)]) == 3 and promoter.dropped == 7
        busy.clear()
        assert promoter.wait_idle(10) and len(store.reads) == 3
    finally:
        promoter.close()


def test_a_newer_submission_takes_the_place_of_the_oldest_ones_last_keys():
    """Bound full: the prompt further back (submitted later) displaces the end of the earliest one's chain."""
    earlier, middle, later = [b"a1", b"a2", b"a3"], [b"b1", b"b2"], [b"c1", b"c2"]
    store, busy = StubStore(earlier + middle + later), threading.Event()
    busy.set()
    promoter = Promoter(store, chunk_bytes=100, max_bytes=500, busy=busy.is_set)  # five chunks at most
    try:
        assert promoter.submit(earlier) == 3 and promoter.submit(middle) == 2
        assert promoter.submit(later) == 2 and promoter.dropped == 2  # a3, then a2
        busy.clear()
        assert promoter.wait_idle(10)
    finally:
        promoter.close()
    assert sorted(store.reads) == sorted([b"a1", *middle, *later])  # negative control: a2, a3 never read


def test_the_latest_submission_goes_first_each_in_order():
    """A step's keys (prompts further back in the queue) before an earlier step's that are still queued."""
    earlier, later = [b"a1", b"a2", b"a3"], [b"b1", b"b2"]
    store, busy = StubStore(earlier + later), threading.Event()
    busy.set()
    promoter = Promoter(store, chunk_bytes=100, max_bytes=1000, busy=busy.is_set)
    try:
        promoter.submit(earlier)
        promoter.submit(later)
        busy.clear()
        assert promoter.wait_idle(10)
    finally:
        promoter.close()
    reads = store.reads
    assert sorted(reads) == sorted(earlier + later)
    # (the thread may have taken a1 before the later keys came)
    assert reads.index(b"b2") < reads.index(b"a2") < reads.index(b"a3") and reads.index(b"b1") < reads.index(b"b2")


def test_only_a_disk_with_room_to_spare_is_read_beside_loads():
    def speed(gb_per_s, memory=False):
        return DiskSpeed(int(gb_per_s * 1e9), 1.0, 1, "scratch", False, memory)

    assert not beside_loads(None)  # not measured: the loads' alone
    assert not beside_loads(speed(1.5))  # the device's disk: promotions would slow the loads they wait for
    assert beside_loads(speed(1.5, memory=True))  # a tmpfs: copies, whatever the probe's few files said
    assert beside_loads(speed(12))  # NVMe RAID


def reads_at_once(store, read_s: float) -> list[int]:
    """Make each of ``store``'s reads take ``read_s``; returns a list whose one entry becomes the
    most reads that ran at once."""
    inside, most, lock, get = [0], [0], threading.Lock(), store.get

    def slow_get(key, background=False):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(read_s)
        with lock:
            inside[0] -= 1
            return get(key, background)

    store.get = slow_get
    return most


@pytest.mark.parametrize("readers", [1, 4])
def test_readers_read_that_many_chunks_at_once_each_key_once(readers):
    """A fast medium's promoter (4 readers) reads chunks at once; a slow disk's (1) one at a time."""
    keys = [bytes([i]) for i in range(12)]
    store, busy = StubStore(keys), threading.Event()
    most = reads_at_once(store, 0.02)
    promoter = Promoter(store, chunk_bytes=100, max_bytes=10_000, busy=busy.is_set, readers=readers)
    try:
        promoter.submit(keys)
        assert promoter.wait_idle(10)
    finally:
        promoter.close()
    assert sorted(store.reads) == keys and promoter.promoted == 12
    assert most[0] == readers
