"""READs and WRITEs of host memory posted at once: on one host UCX copies one (``cma``) inside the
posting call, so a transfer's chunks are copied on several cores only if several threads post them.

Real NIXL over UCX between this process and a producer process; the only stand-in is a barrier
around NIXL's posting call, which lets a transfer through only once another is being posted beside it."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from kvtier.pd import nixl

CHUNK = 8 << 20  # bytes per transfer
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


@pytest.mark.skipif(nixl.POSTERS < 2, reason="one core: transfers are posted one at a time")
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_transfers_of_host_memory_are_copied_on_several_threads_at_once(producer, op):
    metadata, address = producer
    agent = nixl.make_agent()
    mine = torch.zeros(CHUNK * CHUNKS, dtype=torch.uint8)
    agent.register([(mine.data_ptr(), mine.numel())])
    peer = agent.connect(metadata)
    expected = torch.arange(CHUNK * CHUNKS, dtype=torch.int64).to(torch.uint8)
    if op == "WRITE":  # the producer's pool already holds ``expected``: write its reverse over the first chunks
        expected = expected.flip(0)
        mine.copy_(expected)
    beside = threading.Barrier(2, timeout=20)  # broken (the transfer fails) if posts ran one after another
    post = agent._nixl.transfer

    def post_beside_another(handle):
        beside.wait()
        return post(handle)

    agent._nixl.transfer = post_beside_another
    move = agent.read if op == "READ" else agent.write
    transfers = [move(peer, [(mine.data_ptr() + i * CHUNK, CHUNK)], [(address + i * CHUNK, CHUNK)]) for i in range(2)]
    for transfer in transfers:
        transfer.wait(30)
        transfer.release()
    agent._nixl.transfer = post
    if op == "WRITE":  # read the producer's chunks back
        mine.zero_()
        back = agent.read(peer, [(mine.data_ptr(), 2 * CHUNK)], [(address, 2 * CHUNK)])
        back.wait(30)
        back.release()
    assert torch.equal(mine[: 2 * CHUNK], expected[: 2 * CHUNK])
    agent.close()
