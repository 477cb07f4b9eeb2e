"""A shared tier written at one TP size, read at another, through the real worker halves (each rank its
own worker half and store) and a real Valkey server: a TP=2 engine's rank 0 answers lookups with the
pieces a TP=1 engine stored (and the other way round), and each rank's load builds its own piece from
them, byte for byte.

KV memory as vLLM-CPU lays it out, ``[NUM_BLOCKS, heads, BLOCK, 2*head]`` per layer: an engine of two KV
heads holds both at TP=1 and one per rank at TP=2 (rank r: head r)."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.config import KvtierConfig
from kvtier.engines.vllm.worker_side import WorkerSide
from kvtier.jobs import LoadJob, SaveJob
from kvtier.keys import chunk_keys, namespace
from kvtier.lookup import LookupClient

BLOCK, CHUNK, NUM_BLOCKS, HEADS, LAYERS = 16, 32, 32, 2, 2
KEYS = chunk_keys(list(range(3 * CHUNK)), CHUNK, namespace("tiny"))  # three chunks: 6 blocks
SAVED, LOADED = tuple(range(2, 8)), tuple(range(20, 26))


@pytest.fixture
def engines(tmp_path, valkey_factory):
    """``make(name, tp)``: an engine's ranks over one random full KV ``[LAYERS, NUM_BLOCKS, HEADS, BLOCK, 32]``
    (returned too), all on one Valkey server."""
    url = valkey_factory().url
    made: list[WorkerSide] = []

    def make(name: str, tp: int, seed: int) -> tuple[list[WorkerSide], torch.Tensor]:
        full = torch.randn(LAYERS, NUM_BLOCKS, HEADS, BLOCK, 32, generator=torch.Generator().manual_seed(seed))
        config = KvtierConfig.from_dict({"chunk_tokens": CHUNK, "cpu_bytes": 16 << 20, "shared_url": url})
        ranks, per = [], HEADS // tp
        for rank in range(tp):
            kv = full[:, :, rank * per : (rank + 1) * per]  # a view: the rank's KV is the engine's
            side = WorkerSide(config, "tiny", BLOCK, NUM_BLOCKS, f"ipc://{tmp_path}/{name}.sock", rank, tp,
                              produce=False, heads=(per, HEADS))
            side.register({f"layer.{i}": kv[i] for i in range(LAYERS)})
            made.append(side)
            ranks.append(side)
        return ranks, full

    yield make
    for side in made:
        side.close()


def lookup(rank0: WorkerSide, want: list[str]) -> list[str]:
    client = LookupClient(rank0.node.endpoint)
    try:  # every rank's report reaches rank 0 a moment after its start
        deadline = time.monotonic() + 10
        while (tiers := client.prefix_tiers(KEYS)) != want and time.monotonic() < deadline:
            time.sleep(0.02)
        return tiers
    finally:
        client.close()


def load(ranks: list[WorkerSide]) -> None:
    for side in ranks:
        side.start_loads((LoadJob("r", tuple(KEYS), 0, LOADED),))
    for side in ranks:
        deadline = time.monotonic() + 20
        while "r" not in side.finished_loads():
            assert time.monotonic() < deadline, "the load never reported"
            time.sleep(0.005)
        assert side.failed_blocks() == set()


@pytest.mark.parametrize("write_tp,read_tp", [(1, 2), (2, 1)], ids=["tp1-to-tp2", "tp2-to-tp1"])
def test_a_shared_tier_written_at_one_tp_size_is_read_at_another(engines, write_tp, read_tp):
    writers, written = engines("w", write_tp, 1)
    readers, read = engines("r", read_tp, 2)
    assert lookup(readers[0], []) == []  # nothing stored yet: no hit (the control)
    for side in writers:
        side.save((SaveJob("w", tuple(KEYS), SAVED),))
    assert all(side.node.settle() for side in writers)
    assert lookup(readers[0], ["shared"] * len(KEYS)) == ["shared"] * len(KEYS)
    load(readers)
    assert torch.equal(read[:, list(LOADED)], written[:, list(SAVED)])
    # Each reader rank stored the piece it built under its own key: its next lookup is a local hit.
    assert all(side.node.settle() for side in readers)
    assert lookup(readers[0], ["cpu"] * len(KEYS)) == ["cpu"] * len(KEYS)
