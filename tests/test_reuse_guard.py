"""ReuseGuard's decision of when a step waits for a save's reads, and the count of those waits.

CUDA events and streams cannot run on this machine: stand-ins take their place here (an event
whose ``query`` says whether it passed, a stream that records what it waited for). The real
events and streams are exercised by the GPU tests in tests/test_transfer.py."""

from __future__ import annotations

import pytest
import torch

from kvtier.transfer.reuse import ReuseGuard


class Event:
    """Stands in for ``torch.cuda.Event``: ``passed`` is what ``query`` answers."""

    def __init__(self, passed: bool = False):
        self.passed = passed

    def query(self) -> bool:
        return self.passed


class Stream:
    def __init__(self):
        self.waited: list[Event] = []

    def wait_event(self, event: Event) -> None:
        self.waited.append(event)


@pytest.fixture
def engine(monkeypatch) -> Stream:
    stream = Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    return stream


def test_a_step_waits_only_for_a_save_still_reading_a_block_it_was_given(engine):
    guard = ReuseGuard(torch.device("cpu"), defer=True)
    assert guard.guard((1, 2)) is False  # no save at all
    old, new = Event(), Event()
    for event, blocks in ((old, (1, 2)), (new, (2, 3))):
        guard.blocks_read(engine, event)
        guard.saved(blocks, torch.tensor(blocks))
    assert guard.guard((7, 8)) is False and engine.waited == []  # blocks no save reads
    assert guard.guard(()) is False
    assert guard.guard((2,)) is True  # both saves read block 2: the newer one's event covers both
    assert engine.waited == [new] and guard.reuse_after is new
    old.passed = new.passed = True
    assert guard.guard((2, 3)) is False and engine.waited == [new]  # read by now: nothing to wait for
    assert not guard._unread  # and their records are dropped


def test_without_defer_the_engine_stream_waits_for_every_save_at_once(engine):
    guard = ReuseGuard(torch.device("cpu"), defer=False)
    event = Event()
    guard.blocks_read(engine, event)
    guard.saved((1,), torch.tensor([1]))
    assert engine.waited == [event] and guard.guard((1,)) is False  # nothing left for a step to wait for


def test_the_tier_worker_counts_each_step_that_waited():
    from kvtier.layout import build_layout
    from kvtier.storage import ChunkStore, StoreConfig
    from kvtier.transfer import TierWorker

    kv = torch.zeros(16, 2, 2, 16, 16)  # [blocks, K/V, heads, block size, head size]
    store = ChunkStore(StoreConfig(cpu_bytes=4 << 20))
    worker = TierWorker(build_layout({"l0": kv}, 16, 16), store, 2)
    answers = iter((False, True, True))
    worker.reuse.guard = lambda allocated: next(answers)  # stand-in for a guard that saw CUDA reads pending
    try:
        for allocated in ((1,), (2,), (3,)):
            worker.guard_reuse(allocated)
        assert worker.stats.reuse_waits == 2
    finally:
        worker.close()
        store.close()
