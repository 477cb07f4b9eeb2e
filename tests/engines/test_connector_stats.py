"""kvtier's connector stats in vLLM's interface: they cross processes as plain data and add up."""

from __future__ import annotations

import pickle

import msgspec
import pytest

pytest.importorskip("vllm")

from kvtier.engines.vllm.connector import KvtierConnector  # noqa: E402
from kvtier.engines.vllm.stats import KvtierStats  # noqa: E402
from kvtier.engines.vllm.worker_side import STATS_FIELDS  # noqa: E402
from kvtier.transfer import TransferStats  # noqa: E402

RANK0 = {"hit_tokens_cpu": 512, "hit_tokens_disk": 256, "hit_tokens_remote": 64, "hit_tokens_shared": 128, "loaded_bytes": 3 << 20, "saved_bytes": 1 << 20,
         "load_ms": 2.0, "save_ms": 4.0, "dropped_saves": 1, "failed_loads": 0}
RANK1 = {**RANK0, "hit_tokens_cpu": 0, "hit_tokens_disk": 0, "hit_tokens_remote": 0, "hit_tokens_shared": 0}


def test_every_stat_comes_from_a_transfer_counter():
    assert set(STATS_FIELDS) <= set(TransferStats.__slots__)
    assert set(STATS_FIELDS.values()) == set(RANK0)


def test_stats_survive_the_trip_from_worker_to_logger_and_sum_over_ranks():
    # Worker -> scheduler: the object (pickled by the executor); scheduler -> logger: its dict (msgpack).
    worker = pickle.loads(pickle.dumps(KvtierStats(data=dict(RANK0))))
    total = worker.aggregate(KvtierStats(data=dict(RANK1)))
    sent = msgspec.msgpack.decode(msgspec.msgpack.encode(total.to_dict()))
    rebuilt = KvtierConnector.build_kv_connector_stats(sent)
    assert isinstance(rebuilt, KvtierStats)
    reduced = rebuilt.reduce()
    assert reduced["hit_tokens_cpu"] == 512 and reduced["hit_tokens_disk"] == 256  # counted once
    assert reduced["loaded_bytes"] == 6 << 20 and reduced["dropped_saves"] == 2
    assert reduced["load_GBps"] == round((6 << 20) / 4.0 / 1e6, 3)
    assert not rebuilt.is_empty()
    rebuilt.reset()
    assert rebuilt.is_empty() and KvtierConnector.build_kv_connector_stats(None).is_empty()


def test_shared_tier_write_counters_are_reported_as_deltas():
    from kvtier.engines.vllm.worker_side import SHARED_STATS_FIELDS, WorkerSide

    class Store:
        counters = {"up": 1, "writes": 3, "dropped_writes": 1, "failed_writes": 0, "reads": 2}

        def shared_stats(self):
            return dict(self.counters)

    class Transfers:
        stats = TransferStats()

    side = WorkerSide.__new__(WorkerSide)
    side.rank, side.store, side.transfers = 1, Store(), Transfers()
    side._reported, side._shared_reported = TransferStats(), {}
    first = side.take_stats()
    assert {k: first[k] for k in SHARED_STATS_FIELDS.values()} == {
        "shared_writes": 3, "shared_dropped_writes": 1, "shared_failed_writes": 0}
    assert side.take_stats() is None  # nothing new
    Store.counters["writes"] = 5
    assert side.take_stats()["shared_writes"] == 2
