"""A chunk server's WRITEs (:class:`kvtier.pd.producer.writes.PeerWrites`, :class:`kvtier.pd.producer.hbm_serve.HbmServing`)
when NIXL or CUDA raise: real NIXL agents over UCX on loopback, a consumer's memory registered
with its agent, and the fault raised where NIXL's or CUDA's own call would raise it.

No exception escapes: every chunk is answered exactly once (written, or its stored copy as a
payload, or handed to the retry path), and each stored copy is released exactly once."""

from __future__ import annotations

import pytest
import torch

from kvtier.pd import nixl
from kvtier.pd.hbm import EngineBlocks, RegionSpan
from kvtier.pd.producer.hbm_serve import HbmServing
from kvtier.pd.producer.leases import BlockLeases
from kvtier.pd.protocol import VERSION, ChunkReplies, Fetch
from kvtier.pd.producer.writes import BlockWrite, PeerWrites
from kvtier.storage import ChunkBuffer, Tier
from pd_workers import wait_for

pytestmark = pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed: make test installs nixl-cu12")
CHUNK = 64 << 10  # bytes


class _Ref:
    """The pool reference a stored copy owns: counts how often it is given back."""

    def __init__(self):
        self.count = 0

    def ref_count_down(self) -> None:
        self.count += 1


class Consumer:
    """The consumer's memory, registered with its own agent, and what the producer sent it."""

    def __init__(self, producer: nixl.Agent):
        self.agent = nixl.make_agent()
        self.memory = torch.zeros(8 * CHUNK, dtype=torch.uint8)
        self.agent.register([(self.memory.data_ptr(), self.memory.numel())])
        self.peer = producer.connect(self.agent.metadata())
        self.sent: list[tuple[int, str, bool, bool]] = []  # (chunk index, status, written, with payload)
        self.retried: list[int] = []

    def send(self, identity: bytes, reply, payload=None, out_of_band: bool = False) -> None:
        for r in reply.replies if isinstance(reply, ChunkReplies) else (reply,):
            self.sent.append((r.index, r.status, r.written, payload is not None and not out_of_band))

    def retry(self, identity: bytes, fetch: Fetch) -> None:
        self.retried.append(fetch.index)

    def answered(self, index: int) -> int:
        return sum(1 for i, *_ in self.sent if i == index) + self.retried.count(index)


@pytest.fixture
def producer():
    agent = nixl.make_agent()
    pool = torch.arange(8 * CHUNK, dtype=torch.int64).to(torch.uint8)
    agent.register([(pool.data_ptr(), pool.numel())])
    yield agent, pool
    agent.close()


def stored(pool: torch.Tensor, i: int) -> tuple[ChunkBuffer, _Ref]:
    ref = _Ref()
    return ChunkBuffer(pool[i * CHUNK:(i + 1) * CHUNK], Tier.CPU, ref), ref


def test_a_handle_nixl_will_not_take_back_answers_each_write_once(producer, monkeypatch):
    """``release_xfer_handle`` raises (NIXL could not cancel or free the handle): before, the
    exception left the list of WRITEs as it was, and the next turn answered the chunks before it
    again, the second time from a buffer already given back."""
    agent, pool = producer
    d = Consumer(agent)
    writes = PeerWrites(d.send, d.retry, 10.0)

    def refuse(handle):
        raise RuntimeError("NIXL_ERR_BACKEND")

    monkeypatch.setattr(agent._nixl, "release_xfer_handle", refuse)
    refs = []
    for i in range(3):
        buffer, ref = stored(pool, i)
        refs.append(ref)
        fetch = Fetch(VERSION, "t1", i, b"k" * 32, 2, True, d.memory.data_ptr() + i * CHUNK, CHUNK)
        writes.start(agent, d.peer, b"d", fetch, buffer)
    wait_for(lambda: (d.agent.progress(), writes.poll(), not writes)[2])  # a first WRITE needs D's progress
    assert [r.count for r in refs] == [1, 1, 1]
    assert [d.answered(i) for i in range(3)] == [1, 1, 1] and writes.written_total == 3
    assert torch.equal(d.memory[: 3 * CHUNK], pool[: 3 * CHUNK])


@pytest.mark.parametrize("fault", ["bind_device", "refused"])
def test_a_write_of_engine_blocks_whose_posting_raises_falls_back(producer, monkeypatch, fault):
    """A WRITE of engine blocks (``VRAM``) is posted on the server's thread, after binding its
    CUDA device: binding raises (a CUDA error), or NIXL refuses it (here the blocks are host
    memory, registered as DRAM). Before, a CUDA error escaped ``flush()``: the chunks went
    unanswered (the consumer waited out its timeout) and their stored copies were never released."""
    agent, pool = producer
    d = Consumer(agent)
    writes = PeerWrites(d.send, d.retry, 10.0)
    serving = HbmServing(d.send, writes)
    block = CHUNK // 2
    serving.engine = EngineBlocks((RegionSpan(pool.data_ptr(), block, block),), 0, BlockLeases(2, block, 1.0), block, "VRAM")

    def fail() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    if fault == "bind_device":
        monkeypatch.setattr(agent, "bind_device", fail)
    theirs = (RegionSpan(d.memory.data_ptr(), block, block),)
    serving._targets[b"d"] = (d.peer, theirs, 0)
    buffer, ref = stored(pool, 0)
    chunks = [BlockWrite(b"d", Fetch(VERSION, "t1", 0, b"k" * 32, 2, True, hbm=True, blocks=(0, 1)), buffer, (2, 3), 7),
              BlockWrite(b"d", Fetch(VERSION, "t1", 1, b"q" * 32, 2, True, hbm=True, blocks=(2, 3)), None, (4, 5), 9)]
    serving._batch[b"d"] = chunks
    serving.flush(agent)  # raises nothing
    wait_for(lambda: (d.agent.progress(), writes.poll(), not writes)[2])
    assert ref.count == 1 and writes.failed_total == 2
    assert d.sent == [(0, "ok", False, True)] and d.retried == [1]  # the stored copy as a payload; the other retried
