"""kvtier's connector stats in vLLM's interface: they cross processes as plain data and add up."""

from __future__ import annotations

import pickle
from collections import deque
from types import SimpleNamespace

import msgspec
import pytest

pytest.importorskip("vllm")

from kvtier.config import KvtierConfig  # noqa: E402
from kvtier.engines.vllm.connector import KvtierConnector  # noqa: E402
from kvtier.engines.vllm.stats import KvtierStats  # noqa: E402
from kvtier.engines.vllm.worker_side import STATS_FIELDS  # noqa: E402
from kvtier.transfer import TransferStats  # noqa: E402

RANK0 = {"hit_tokens_cpu": 512, "hit_tokens_disk": 256, "hit_tokens_remote": 64, "hit_tokens_shared": 128, "loaded_bytes": 3 << 20, "landed_bytes": 1 << 20, "saved_bytes": 1 << 20,
         "load_ms": 2.0, "save_ms": 4.0, "dropped_saves": 1, "failed_loads": 0, "engine_waits_save_reads": 3,
         "engine_waits_save_backlog": 1, "engine_wait_ms_save_backlog": 12.5}
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
    assert reduced["engine_waits_save_reads"] == 6 and reduced["engine_wait_ms_save_backlog"] == 25.0
    assert reduced["load_GBps"] == round((6 << 20) / 4.0 / 1e6, 3)
    assert not rebuilt.is_empty()
    rebuilt.reset()
    assert rebuilt.is_empty() and KvtierConnector.build_kv_connector_stats(None).is_empty()


def test_batch_times_concatenate_and_gauges_keep_each_ranks_latest():
    step1 = KvtierStats(data={"load_batch_ms": [3.0], "held_bytes_cpu": {"0": 100, "1": 100}})
    step2 = KvtierStats(data={"load_batch_ms": [5.0, 1.0], "held_bytes_cpu": {"0": 40}})
    total = step1.aggregate(step2)
    assert total.data["load_batch_ms"] == [3.0, 5.0, 1.0]
    assert total.data["held_bytes_cpu"] == {"0": 40, "1": 100}
    assert total.reduce()["held_bytes_cpu"] == 140 and total.reduce()["load_batch_ms_max"] == 5.0
    assert not KvtierStats(data={"held_bytes_disk": {"0": 0}}).is_empty()  # a gauge that fell to 0 still travels


def test_prometheus_metrics_move_by_what_the_stats_say():
    prometheus_client = pytest.importorskip("prometheus_client")
    from functools import partial

    registry = prometheus_client.CollectorRegistry()
    types = {cls: partial(cls, registry=registry)
             for cls in (prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram)}
    config = type("VllmConfig", (), {"kv_transfer_config": None})()  # all the base class reads of it
    prom = KvtierConnector.build_prom_metrics(config, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    for _ in range(2):
        prom.observe({**RANK0, "hit_tokens_shared": 32, "shared_dropped_writes": 3,
                      "load_batch_ms": [2.0, 40.0], "save_batch_ms": [7.0],
                      "held_bytes_cpu": {"0": 1 << 20, "1": 3 << 20}, "held_bytes_disk": {"0": 5},
                      "held_bytes_hbm": {"0": 7}}, engine_idx=1)

    def value(name, **labels):
        return registry.get_sample_value(name, {"model_name": "m", "engine": "1", **labels})

    assert value("vllm:kvtier_hit_tokens_total", tier="cpu") == 1024
    assert value("vllm:kvtier_hit_tokens_total", tier="remote") == 128
    assert value("vllm:kvtier_hit_tokens_total", tier="shared") == 64
    assert value("vllm:kvtier_shared_writes_total", outcome="dropped") == 6
    assert value("vllm:kvtier_loaded_bytes_total") == 6 << 20
    assert value("vllm:kvtier_landed_bytes_total") == 2 << 20  # P/D bytes that came HBM to HBM
    assert value("vllm:kvtier_dropped_saves_total") == 2
    assert value("vllm:kvtier_engine_waits_total", cause="save_reads") == 6  # where kvtier held the engine
    assert value("vllm:kvtier_engine_waits_total", cause="save_backlog") == 2
    assert value("vllm:kvtier_load_seconds_count") == 4 and value("vllm:kvtier_save_seconds_count") == 2
    assert value("vllm:kvtier_load_seconds_bucket", le="0.0025") == 2  # the two 2 ms loads
    assert value("vllm:kvtier_held_bytes", tier="cpu") == 4 << 20  # a gauge: set, not added
    assert value("vllm:kvtier_held_bytes", tier="disk") == 5
    assert value("vllm:kvtier_held_bytes", tier="hbm") == 7  # a producer's blocks under leases
    assert registry.get_sample_value("vllm:kvtier_loaded_bytes_total", {"model_name": "m", "engine": "0"}) is None


def test_shared_tier_write_counters_are_reported_as_deltas():
    from kvtier.engines.vllm.worker_side import SHARED_STATS_FIELDS, WorkerSide

    class Store:
        counters = {"up": 1, "writes": 3, "dropped_writes": 1, "failed_writes": 0, "reads": 2}

        def shared_stats(self):
            return dict(self.counters)

        def cpu_bytes_used(self):
            return 0

        disk_bytes_used = cpu_bytes_used

    class Transfers:
        stats = TransferStats()
        batch_ms = {"load": deque(), "save": deque()}

    transfers = Transfers()
    side = WorkerSide(KvtierConfig(), "m", 16, 4, "ipc://unused", 1, 2)
    side.node = SimpleNamespace(store=Store(), transfers=transfers, group_transfers=[transfers], engine_kv=None,
                                take_failed_loads=set)  # what take_stats reads of a registered worker node
    side.take_stats()  # the held-bytes gauges' first report
    Store.counters["writes"] += 3
    Store.counters["dropped_writes"] += 1
    first = side.take_stats()
    assert {k: first[k] for k in SHARED_STATS_FIELDS.values()} == {
        "shared_writes": 3, "shared_dropped_writes": 1, "shared_failed_writes": 0}
    assert side.take_stats() is None  # nothing new
    Store.counters["writes"] += 2
    assert side.take_stats()["shared_writes"] == 2
