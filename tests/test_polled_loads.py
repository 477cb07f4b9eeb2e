"""Polled loads (:mod:`kvtier.transfer.polled`) on the real store, with the copy's CUDA event stood in for.

On a GPU a load from the CPU tier starts its copies on the copy engines and is reported once
their event fires. This machine has no GPU, so the copies here run at once with the CPU backend
and ``_Event`` stands for the CUDA event: the test says when it fires. The same path on CUDA runs
in tests/gpu (the tiers and served modules).
"""

from __future__ import annotations

import threading

import torch

from kvtier import codec
from kvtier.jobs import LoadJob
from kvtier.keys import storage_key
from kvtier.storage import Tier
from kvtier.transfer import TierWorker
from kvtier.transfer.polled import PolledLoads
from test_transfer import CHUNK_BLOCKS, blocks, engine_kv, keys, save_job, stores  # noqa: F401 (fixture)


class _Event:
    """Stands for a batch's CUDA event: fired by the test (``fire``), asked by ``ready``."""

    def __init__(self, ok: list[bool]):
        self.ok, self.fired = ok, threading.Event()

    def ready(self) -> bool:
        return self.fired.is_set()

    def wait(self) -> list[bool]:
        assert self.fired.wait(10), "waited for copies that never ended"
        return self.ok

    def elapsed_ms(self) -> float:
        return 1.0


def polled_worker(layout, store) -> tuple[TierWorker, list[_Event]]:
    """A worker whose CPU-tier loads are polled; its scatters copy now and return an event each,
    which the test fires for a polled load (``started``, in order)."""
    worker = TierWorker(layout, store, CHUNK_BLOCKS)
    side, started = worker.loads, []

    def scatter_async(layout, spans, expected):
        event = _Event(side._scatter(layout, spans, expected))
        if threading.current_thread() is threading.main_thread():
            started.append(event)  # a polled load's: fired by the test
        else:
            event.fired.set()  # the load thread's, which waits for its copies itself
        return event

    side.scatter_async = scatter_async
    side._polled = PolledLoads(side)
    return worker, started


def test_each_load_is_reported_once_its_copies_end_whatever_the_order(stores):
    alloc, layout = engine_kv()
    worker, started = polled_worker(layout, stores())
    ks = keys(4)
    try:
        worker.save([save_job(ks)])
        worker.drain()
        worker.submit_load(LoadJob("a", tuple(ks[:2]), 0, tuple(range(40, 44))))
        worker.submit_load(LoadJob("b", tuple(ks), 0, tuple(range(48, 56))))
        assert len(started) == 2  # both in flight, neither behind the other
        assert worker.take_finished() == (set(), set())
        started[1].fired.set()
        assert worker.take_finished() == ({"b"}, set())
        started[0].fired.set()
        assert worker.take_finished() == ({"a"}, set())
        assert torch.equal(blocks(alloc, range(48, 56)), blocks(alloc, range(8)))
        assert torch.equal(blocks(alloc, range(40, 44)), blocks(alloc, range(4)))
        assert worker.stats.cpu_hit_tokens == 12 * layout.block_size
    finally:
        worker.close()


def test_waiting_on_a_polled_load_finishes_it(stores):
    alloc, layout = engine_kv()
    worker, started = polled_worker(layout, stores())
    ks = keys(2)
    try:
        worker.save([save_job(ks)])
        worker.drain()
        future = worker.submit_load(LoadJob("a", tuple(ks), 0, tuple(range(40, 44))))
        assert worker.wait_finished(0.01) and not future.done()  # the event has not fired: it gives up
        threading.Timer(0.05, started[0].fired.set).start()
        future.result(timeout=5)
        assert worker.take_finished() == ({"a"}, set())
    finally:
        worker.close()


def test_a_corrupt_chunk_fails_its_blocks_from_there_and_is_removed(stores, caplog):
    alloc, layout = engine_kv()
    store = stores()
    worker, started = polled_worker(layout, store)
    ks = keys(3)
    try:
        worker.save([save_job(ks)])
        worker.drain()
        victim = storage_key(ks[1], layout.fingerprint)
        held = store.get(victim)
        held.data[codec.HEADER_BYTES + 7] ^= 0xFF  # bit rot in the CPU tier: only the copy's checksum sees it
        held.release()
        worker.submit_load(LoadJob("a", tuple(ks), 0, tuple(range(40, 46))))
        assert started and started[0].ok == [True, False, True]
        started[0].fired.set()
        assert worker.take_finished() == ({"a"}, set(range(42, 46)))
        assert store.contains(victim) is None and "unusable" in caplog.text
    finally:
        worker.close()


def test_a_load_with_a_chunk_on_disk_goes_to_the_load_thread(stores, tmp_path):
    alloc, layout = engine_kv()
    ks = keys(2)
    writer = TierWorker(layout, stores(disk=tmp_path), CHUNK_BLOCKS)
    writer.save([save_job(ks)])
    writer.close()
    writer.store.close()  # waits for the write-through
    store = stores(disk=tmp_path)  # restarted: the chunks are on disk only
    assert store.contains(storage_key(ks[1], layout.fingerprint)) is Tier.DISK
    worker, started = polled_worker(layout, store)
    try:
        worker.submit_load(LoadJob("a", tuple(ks), 0, tuple(range(40, 44)))).result(timeout=10)
        assert not started  # not polled: the load thread read the disk chunks
        assert worker.take_finished() == ({"a"}, set())
        assert worker.stats.disk_hit_tokens == 4 * layout.block_size
        assert torch.equal(blocks(alloc, range(40, 44)), blocks(alloc, range(4)))
    finally:
        worker.close()
