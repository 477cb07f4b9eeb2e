"""A P/D producer's KVSUM64s of a step's chunks reach the host before that step's copy-out does
(:mod:`kvtier.pd.producer.sums`): the copy-out waits for the checksum pass, else the sums' few bytes
queue behind it on the copy engines and a decode engine is answered only as the stored copies
land. Needs a CUDA device: the order is the copy engines'."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier import codec
from kvtier.jobs import SaveJob
from kvtier.keys import chunk_keys, namespace
from kvtier.layout import build_layout
from kvtier.pd.producer.sums import EarlySums
from kvtier.storage import ChunkStore, StoreConfig
from kvtier.transfer import TierWorker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCK, CHUNK_BLOCKS, CHUNKS = 16, 16, 64  # 8 layers of 64 KiB a block: 8 MiB a chunk, 512 MiB in all
LAYERS, HEADS, HEAD_DIM = 8, 8, 128


def test_a_steps_checksums_come_before_its_copy_out_lands():
    num_blocks = CHUNKS * CHUNK_BLOCKS
    kv = {f"l{i}": torch.randn(num_blocks, 2, BLOCK, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
          for i in range(LAYERS)}
    layout = build_layout(kv, BLOCK, num_blocks)
    store = ChunkStore(StoreConfig(cpu_bytes=CHUNKS * codec.chunk_bytes(layout, CHUNK_BLOCKS) + (64 << 20)))
    worker = TierWorker(layout, store, CHUNK_BLOCKS)
    sums = EarlySums(layout, CHUNK_BLOCKS)
    keys = tuple(chunk_keys(list(range(CHUNKS * CHUNK_BLOCKS * BLOCK)), CHUNK_BLOCKS * BLOCK, namespace("m")))
    ids = tuple(range(num_blocks))
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # the step's forward, still running when its sums and copy-out are queued
        after = sums.take("t", keys, ids)
        worker.save([SaveJob("r", keys, ids)], after=after)
        copies = [item.ready for item in list(worker.saves._backlog)]  # each chunk's copy-out
        assert after is not None and len(copies) == CHUNKS
        came: set[bytes] = set()
        deadline = time.monotonic() + 30
        while len(came) < CHUNKS and time.monotonic() < deadline:
            came |= sums.poll()
        assert len(came) == CHUNKS
        assert not all(event.query() for event in copies if event is not None)  # the last chunks still copying
        worker.drain()
        for key in keys:  # the save's own checksums agree with the early ones
            buffer = store.get(worker.skey(key))
            assert buffer is not None
            assert codec.read_header(buffer.data).checksum == sums.get("t", key, CHUNK_BLOCKS)
            buffer.release()
    finally:
        worker.close()
        store.close()
