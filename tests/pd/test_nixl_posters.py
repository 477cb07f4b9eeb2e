"""READs of host memory posted at once: on one host UCX copies a READ (``cma``) inside the posting
call, so a transfer's chunks are copied on several cores only if several threads post them.

Real NIXL over UCX between this process and a producer process; the only stand-in is a barrier
around NIXL's posting call, which lets a READ through only once another is being posted beside it."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from kvtier.pd import nixl

CHUNK = 8 << 20  # bytes per READ
CHUNKS = 4


def _producer(metadata_out, done) -> None:
    agent = nixl.make_agent()
    pool = torch.arange(CHUNK * CHUNKS, dtype=torch.int64).to(torch.uint8)
    agent.register([(pool.data_ptr(), pool.numel())])
    metadata_out.put((agent.metadata(), pool.data_ptr()))
    while not done.is_set():
        agent.progress()
        time.sleep(0.01)


@pytest.fixture
def producer():
    if not nixl.available():
        pytest.fail("NIXL is not installed: make test installs nixl-cu12")
    ctx = multiprocessing.get_context("spawn")
    metadata, done = ctx.Queue(), ctx.Event()
    process = ctx.Process(target=_producer, args=(metadata, done), daemon=True)
    process.start()
    try:
        yield metadata.get(timeout=60)
    finally:
        done.set()
        process.join(10)


@pytest.mark.skipif(nixl.POSTERS < 2, reason="one core: READs are posted one at a time")
def test_reads_of_one_transfer_are_copied_on_several_threads_at_once(producer):
    metadata, address = producer
    agent = nixl.make_agent()
    mine = torch.zeros(CHUNK * CHUNKS, dtype=torch.uint8)
    agent.register([(mine.data_ptr(), mine.numel())])
    peer = agent.connect(metadata)
    beside = threading.Barrier(2, timeout=20)  # broken (the READ fails) if posts ran one after another
    post = agent._nixl.transfer

    def post_beside_another(handle):
        beside.wait()
        return post(handle)

    agent._nixl.transfer = post_beside_another
    reads = [agent.read(peer, [(mine.data_ptr() + i * CHUNK, CHUNK)], [(address + i * CHUNK, CHUNK)])
             for i in range(2)]
    for read in reads:
        read.wait(30)
        read.release()
    agent._nixl.transfer = post
    expected = torch.arange(CHUNK * CHUNKS, dtype=torch.int64).to(torch.uint8)
    assert torch.equal(mine[: 2 * CHUNK], expected[: 2 * CHUNK])
    agent.close()
