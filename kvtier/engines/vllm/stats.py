"""kvtier's figures in vLLM's connector stats: logged as "KV Transfer metrics" and, through
:class:`KvtierPromMetrics`, exported on the server's ``/metrics`` labelled like vLLM's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

TIERS = ("cpu", "disk", "shared", "remote")
HELD_TIERS = ("cpu", "disk", "hbm")  # hbm: a P/D producer's engine blocks kept under leases
# Per chunk batch (one load job, one step's saves): a chunk is ~1-100 ms, a 32k prompt ~0.1-2 s.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Request ids whose load failed on a hybrid model's workers (vLLM takes no block ids there): a
# message to the scheduler half, which takes it out before the figures are logged or exported.
FAILED_REQUESTS = "failed_load_requests"


@dataclass
class KvtierStats(KVConnectorStats):
    """``data`` holds plain values, so it crosses processes as is, in three kinds:

    * counters, summed over steps and TP ranks: ``hit_tokens_{cpu,disk,shared,remote}`` (tokens
      loaded from each tier, counted once), ``loaded_bytes`` (of which ``landed_bytes``: written
      by a P/D producer straight into engine blocks, HBM to HBM), ``saved_bytes``, ``load_ms``,
      ``save_ms`` (time spent loading / saving, summed over ranks), ``dropped_saves`` (chunks
      dropped from a full save backlog or for want of CPU memory), ``failed_loads`` (loads that
      ended early and recomputed), ``engine_waits_save_reads`` (steps whose stream waited for a
      save still reading blocks given to them), ``engine_waits_save_backlog`` and
      ``engine_wait_ms_save_backlog`` (saves that held the engine thread until their step's
      forward ended, the save backlog full, and for how long); with a shared tier also ``shared_writes``,
      ``shared_dropped_writes`` (write-through backlog full, or the server down) and
      ``shared_failed_writes`` (chunks, summed over ranks);
    * observations, concatenated: ``load_batch_ms`` (one per load job), ``save_batch_ms`` (one
      per step's batch of saved chunks, copy-out to stored);
    * gauges per rank, the latest value kept: ``held_bytes_cpu``, ``held_bytes_disk``,
      ``held_bytes_hbm`` (a P/D producer's engine blocks kept under leases) (``{rank: bytes}``,
      rank as a string).
    """

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, dict):
                self.data[name] = {**self.data.get(name, {}), **value}
            elif isinstance(value, list):
                self.data[name] = [*self.data.get(name, []), *value]
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, value in sorted(self.data.items()):
            if name == FAILED_REQUESTS:
                continue
            if isinstance(value, dict):
                out[name] = sum(value.values())
            elif isinstance(value, list):
                out[f"{name}_max"] = round(max(value, default=0.0), 3)
            else:
                out[name] = round(value, 3)
        for way in ("load", "save"):
            ms, nbytes = self.data.get(f"{way}_ms", 0), self.data.get(f"{way}ed_bytes", 0)
            if ms > 0:
                out[f"{way}_GBps"] = round(nbytes / ms / 1e6, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def build_stats(data: dict[str, Any] | None) -> KvtierStats:
    return KvtierStats(data=dict(data or {}))


class KvtierPromMetrics(KVConnectorPromMetrics):
    """kvtier's counters, histograms and gauges on vLLM's ``/metrics``, per engine (vLLM's
    ``model_name`` and ``engine`` labels), with a ``tier`` label where it applies."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names, tier = self._labelnames, [*self._labelnames, "tier"]
        counter, histogram, gauge = self._counter_cls, self._histogram_cls, self._gauge_cls
        self.hit_tokens = counter(name="vllm:kvtier_hit_tokens", labelnames=tier,
                                  documentation="Prompt tokens kvtier loaded into the engine, by the tier they came from.")
        self.loaded_bytes = counter(name="vllm:kvtier_loaded_bytes", labelnames=names,
                                    documentation="KV bytes kvtier loaded into engine blocks, summed over TP ranks.")
        self.landed_bytes = counter(name="vllm:kvtier_landed_bytes", labelnames=names,
                                    documentation="P/D KV bytes a producer wrote straight into engine blocks "
                                                  "(HBM to HBM), summed over TP ranks.")
        self.saved_bytes = counter(name="vllm:kvtier_saved_bytes", labelnames=names,
                                   documentation="KV bytes kvtier stored in its CPU tier, summed over TP ranks.")
        self.failed_loads = counter(name="vllm:kvtier_failed_loads", labelnames=names,
                                    documentation="Loads that ended early; their blocks were recomputed.")
        self.dropped_saves = counter(name="vllm:kvtier_dropped_saves", labelnames=names,
                                     documentation="Chunks not saved: a full save backlog or no CPU room.")
        self.load_seconds = histogram(name="vllm:kvtier_load_seconds", labelnames=names, buckets=LATENCY_BUCKETS_S,
                                      documentation="Time to load one request's chunk batch, per TP rank.")
        self.save_seconds = histogram(name="vllm:kvtier_save_seconds", labelnames=names, buckets=LATENCY_BUCKETS_S,
                                      documentation="Time from copy-out to stored for one step's chunk batch, per TP rank.")
        self.shared_writes = counter(name="vllm:kvtier_shared_writes", labelnames=[*names, "outcome"],
                                     documentation="Chunks written through to the shared tier, by outcome: "
                                                   "written, dropped (backlog full or server down), failed.")
        self.engine_waits = counter(name="vllm:kvtier_engine_waits", labelnames=[*names, "cause"],
                                    documentation="Times kvtier made the engine wait, by cause: save_reads (a step's "
                                                  "stream waited for a save still reading its blocks), save_backlog "
                                                  "(a save held the engine thread until its step's forward ended).")
        self.held_bytes = gauge(name="vllm:kvtier_held_bytes", labelnames=tier, multiprocess_mode="mostrecent",
                                documentation="Bytes kvtier holds in each tier, summed over TP ranks.")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data, labels = transfer_stats_data, self.per_engine_labelvalues[engine_idx]
        for tier in TIERS:
            if n := data.get(f"hit_tokens_{tier}", 0):
                self.hit_tokens.labels(*labels, tier).inc(n)
        for metric, name in ((self.loaded_bytes, "loaded_bytes"), (self.landed_bytes, "landed_bytes"),
                             (self.saved_bytes, "saved_bytes"),
                             (self.failed_loads, "failed_loads"), (self.dropped_saves, "dropped_saves")):
            if n := data.get(name, 0):
                metric.labels(*labels).inc(n)
        for outcome, name in (("written", "shared_writes"), ("dropped", "shared_dropped_writes"),
                              ("failed", "shared_failed_writes")):
            if n := data.get(name, 0):
                self.shared_writes.labels(*labels, outcome).inc(n)
        for cause in ("save_reads", "save_backlog"):
            if n := data.get(f"engine_waits_{cause}", 0):
                self.engine_waits.labels(*labels, cause).inc(n)
        for metric, name in ((self.load_seconds, "load_batch_ms"), (self.save_seconds, "save_batch_ms")):
            for ms in data.get(name, ()):
                metric.labels(*labels).observe(ms / 1e3)
        for tier in HELD_TIERS:
            if (per_rank := data.get(f"held_bytes_{tier}")) is not None:
                self.held_bytes.labels(*labels, tier).set(sum(per_rank.values()))
