"""A step that computes nothing waits for a load thread to end its job, the interpreter released,
instead of spinning: vLLM's loop steps back to back while requests wait for their loads, and a
load thread that needs the interpreter then gets it only once a switch interval (5 ms)."""

from __future__ import annotations

import threading
import time

from kvtier.jobs import LoadJob
from kvtier.transfer import TierWorker
from test_transfer import CHUNK_BLOCKS, engine_kv, keys, save_job, stores  # noqa: F401  (fixture)


def test_a_wait_ends_when_a_load_ends_and_leaves_its_report_to_be_taken(stores):  # noqa: F811
    _, layout = engine_kv()
    worker = TierWorker(layout, stores(), CHUNK_BLOCKS)
    gate, load = threading.Event(), worker.load
    worker.load = lambda job: load(job) if gate.wait(10) else set(job.block_ids)
    ks = keys(2)
    try:
        worker.save([save_job(ks)])
        worker.drain()
        start = time.monotonic()
        assert not worker.wait_finished(1.0)
        assert time.monotonic() - start < 0.5  # no load out: no wait
        worker.submit_load(LoadJob("r", tuple(ks), 0, tuple(range(40, 44))))
        start = time.monotonic()
        assert worker.wait_finished(0.1)
        assert time.monotonic() - start >= 0.09  # the load is held: the whole wait
        start = time.monotonic()
        worker.wait_finished(0)  # idle_wait_us 0: no wait at all
        assert time.monotonic() - start < 0.05
        threading.Timer(0.1, gate.set).start()
        start = time.monotonic()
        worker.wait_finished(10.0)
        assert time.monotonic() - start < 5  # woken by the load's end, not the timeout
        assert worker.take_finished() == ({"r"}, set())
        start = time.monotonic()
        worker.wait_finished(1.0)
        assert time.monotonic() - start < 0.5  # taken: nothing out any more
    finally:
        gate.set()
        worker.close()

