"""kvtier's counters in vLLM's connector stats interface (logged as "KV Transfer metrics")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class KvtierStats(KVConnectorStats):
    """``data``: counters of an interval, summed over steps and TP ranks (plain numbers, so it
    crosses processes as is). Keys: ``hit_tokens_cpu``, ``hit_tokens_disk``, ``hit_tokens_shared``,
    ``hit_tokens_remote`` (tokens loaded from each tier, counted once), ``loaded_bytes``,
    ``saved_bytes``, ``load_ms``, ``save_ms`` (time spent loading / saving, summed over ranks),
    ``dropped_saves`` (chunks dropped from a full save backlog or for want of CPU memory),
    ``failed_loads`` (loads that ended early and recomputed); with a shared tier also
    ``shared_writes``, ``shared_dropped_writes`` (write-through backlog full, or the server down)
    and ``shared_failed_writes`` (chunks, summed over ranks).
    """

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: round(value, 3) for name, value in sorted(self.data.items())}
        for way in ("load", "save"):
            ms, nbytes = self.data.get(f"{way}_ms", 0), self.data.get(f"{way}ed_bytes", 0)
            if ms > 0:
                out[f"{way}_GBps"] = round(nbytes / ms / 1e6, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def build_stats(data: dict[str, Any] | None) -> KvtierStats:
    return KvtierStats(data=dict(data or {}))
