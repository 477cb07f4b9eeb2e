"""Worker half of the vLLM connector: derives one layout per served KV cache group from the tensors vLLM registers
and starts a :class:`~kvtier.worker_node.WorkerNode` over them (store, transfers, hold reporter, rank 0's lookup
server, P/D pieces: see that module for the commit protocol, P/D and hybrid models). What stays here is vLLM's:
the KV cache events vLLM announces (:mod:`kvtier.engines.vllm.events`, rank 0 only) and the connector stats vLLM
logs and exports (:data:`STATS_FIELDS`). The hooks the connector calls go to the node; its parts are reachable
here under the same names (``store``, ``transfers``, ``chunk_server``, ...) for tests and benches.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from typing import TYPE_CHECKING

import torch

from kvtier.config import KvtierConfig
from kvtier.engines.vllm.groups import blocks_per_chunk, group_layouts
from kvtier.engines.vllm.stats import FAILED_REQUESTS
from kvtier.jobs import LoadJob, Lend, SaveJob, StepPlan
from kvtier.transfer import TransferStats
from kvtier.worker_node import Listener, WorkerNode

if TYPE_CHECKING:
    from kvtier.engines.vllm.events import TierEvents
    from kvtier.pd.nixl import Agent
    from kvtier.storage import ChunkStore
    from kvtier.transfer import TierWorker

# TransferStats field -> name in the connector stats vLLM logs (see kvtier.engines.vllm.stats).
STATS_FIELDS = {
    "cpu_hit_tokens": "hit_tokens_cpu",
    "disk_hit_tokens": "hit_tokens_disk",
    "remote_hit_tokens": "hit_tokens_remote",
    "shared_hit_tokens": "hit_tokens_shared",
    "loaded_bytes": "loaded_bytes",
    "landed_bytes": "landed_bytes",
    "saved_bytes": "saved_bytes",
    "load_ms": "load_ms",
    "save_ms": "save_ms",
    "dropped_saves": "dropped_saves",
    "failed_chunks": "failed_loads",
    "reuse_waits": "engine_waits_save_reads",
    "backlog_waits": "engine_waits_save_backlog",
    "backlog_wait_ms": "engine_wait_ms_save_backlog",
}
# ChunkStore.shared_stats() field -> name in the connector stats (per rank: each writes its shard).
SHARED_STATS_FIELDS = {"writes": "shared_writes", "dropped_writes": "shared_dropped_writes",
                       "failed_writes": "shared_failed_writes"}
_RANK0_ONLY = ("cpu_hit_tokens", "disk_hit_tokens", "remote_hit_tokens", "shared_hit_tokens")  # every rank loads the same tokens


def _node_part(name: str) -> property:
    """``WorkerSide.<name>``: the node's part of that name; None before :meth:`WorkerSide.register`."""
    return property(lambda self: getattr(self.node, name, None),
                    doc=f"The worker node's ``{name}`` (None until registered; see :class:`WorkerNode`).")


class WorkerSide:
    """vLLM's worker half on one rank: owns the :class:`WorkerNode` (from :meth:`register` on) and, on rank 0 with
    KV cache events on, the :class:`TierEvents`; closes both."""

    def __init__(self, config: KvtierConfig, model: str, block_size: int, num_blocks: int, endpoint: str,
                 rank: int, world_size: int, produce: bool = True, kv_events: bool = False, load_inline: bool = False,
                 groups: tuple[tuple[str, int, tuple[str, ...]], ...] = (), heads: tuple[int, int] | None = None):
        self.config = config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.rank = rank
        self.world_size = world_size
        self.endpoint = endpoint
        self.produce = produce
        self.load_inline = load_inline  # local-tier loads on the engine thread (see TierWorker)
        # (kind, window, layers) of each served KV cache group, the anchor first; none: the engine's one, every tensor
        self.groups = groups or (("full_attention", 0, ()),)
        self.heads = heads  # (KV heads per rank, total; (0, 0): MLA) for chunks any TP size reads; None: per rank
        self.node: WorkerNode | None = None
        self.events: TierEvents | None = None
        self._kv_events = kv_events and rank == 0  # one rank announces: every rank holds the same chunks
        self._reported = TransferStats()
        self._held_reported: dict[str, int] = {}  # held_bytes_<tier> as last reported
        self._shared_reported: dict[str, int] = {}

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Start kvtier on this rank over vLLM's KV tensors (layer name -> tensor, or a list of them for a Mamba
        layer on vLLM 0.26); they stay vLLM's."""
        begin = time.perf_counter()
        layouts = group_layouts(kv_caches, self.groups, self.block_size, self.num_blocks, model=self.model,
                                tp_rank=self.rank, tp_size=self.world_size,
                                **({} if self.heads is None else dict(kv_heads=self.heads[0], total_kv_heads=self.heads[1])))
        cb = self.config.chunk_tokens // self.block_size
        chunk_blocks = (cb, *(blocks_per_chunk(kind, cb) for kind, _, _ in self.groups[1:]))
        self.node = WorkerNode(self.config, layouts, chunk_blocks, rank=self.rank, world_size=self.world_size,
                               endpoint=self.endpoint, produce=self.produce, load_inline=self.load_inline,
                               engine=f"vLLM {_vllm_version()}", listen=self._listen if self._kv_events else None,
                               began=begin)

    def _listen(self, store: ChunkStore) -> Listener:
        """Rank 0 with KV cache events on: the events hear every change of the chunks this rank holds."""
        from kvtier.engines.vllm.events import TierEvents  # imports vLLM: only where vLLM runs

        self.events = TierEvents(store.residency)
        return self.events.changed

    store = _node_part("store")
    server = _node_part("server")
    reporter = _node_part("reporter")
    holds = _node_part("holds")
    transfers = _node_part("transfers")
    chunk_server = _node_part("chunk_server")
    engine_kv = _node_part("engine_kv")
    _hello = _node_part("hello")
    _nixl_start = _node_part("nixl_start")

    @property
    def group_transfers(self) -> list[TierWorker]:
        """The node's transfer workers, one per served group, the anchor's first ([] until registered)."""
        return self.node.group_transfers if self.node is not None else []

    @property
    def nixl(self) -> Agent | None:
        """This rank's NIXL agent (see :attr:`WorkerNode.nixl`; benches set None for ZMQ, then set it back)."""
        return self.node.nixl if self.node is not None else None

    @nixl.setter
    def nixl(self, agent: Agent | None) -> None:
        self.node.nixl = agent

    def nixl_ready(self, timeout_s: float = 30.0) -> bool:
        """Wait until NIXL is up (True), or is not to be used here (False)."""
        return self.node is not None and self.node.nixl_ready(timeout_s)

    def guard_reuse(self, plan: StepPlan) -> None:
        self.node.guard_reuse(plan)

    def start_loads(self, jobs: tuple[LoadJob, ...], cancels: tuple[str, ...] = (), busy: bool = False,
                    promotes: tuple[bytes, ...] = ()) -> None:
        self.node.start_loads(jobs, cancels, busy, promotes)

    def announce(self, jobs: tuple[SaveJob, ...], withdrawn: tuple[str, ...] = ()) -> None:
        self.node.announce(jobs, withdrawn)

    def lend(self, lends: tuple[Lend, ...]) -> None:
        self.node.lend(lends)

    def wait_idle(self, timeout_s: float) -> None:
        self.node.wait_idle(timeout_s)

    def finished_sends(self, finished_req_ids: set[str]) -> set[str]:
        return self.node.finished_sends(finished_req_ids)

    def save(self, jobs: tuple[SaveJob, ...]) -> None:
        """After the forward: the chunks' names for KV events are known before any of them lands."""
        if self.events is not None:
            for job in jobs:
                for key, name in zip(job.keys, job.names):
                    if name is not None:
                        self.events.name(self.transfers.skey(key), name)
        self.node.save(jobs)

    def reset(self) -> int:
        return self.node.reset()

    def take_events(self) -> tuple[list, bool]:
        """KV cache events since the last call (rank 0 only; none elsewhere), and whether more
        are on their way (chunks still being stored or written to disk)."""
        if self.events is None:
            return [], False
        settling = self.node.storing()
        return self.events.take(), settling

    def finished_loads(self) -> set[str]:
        return self.node.finished_loads() if self.node is not None else set()

    def take_failed_loads(self) -> set[str]:
        """Requests whose load failed as a whole (a hybrid model's), each once: vLLM's failed receives."""
        return self.node.take_failed_loads() if self.node is not None else set()

    def failed_blocks(self) -> set[int]:
        return self.node.failed_blocks() if self.node is not None else set()

    def take_stats(self) -> dict | None:
        """Counters since the last call, named as in :data:`STATS_FIELDS`; None if all are zero.
        Hit tokens come from rank 0 only, so that summing over ranks counts each token once."""
        if self.transfers is None:
            return None
        now = copy.copy(self.transfers.stats)  # hit tokens: the anchor group's (every group loads the same tokens)
        for other in self.group_transfers[1:]:
            for field in dataclasses.fields(now):
                if field.name not in _RANK0_ONLY:
                    setattr(now, field.name, getattr(now, field.name) + getattr(other.stats, field.name))
        last, self._reported = self._reported, now
        delta: dict = {name: getattr(now, field) - getattr(last, field) for field, name in STATS_FIELDS.items()}
        if self.rank != 0:
            for field in _RANK0_ONLY:
                delta[STATS_FIELDS[field]] = 0
        for way in ("load", "save"):
            delta[f"{way}_batch_ms"] = [t.batch_ms[way].popleft() for t in self.group_transfers
                                        for _ in range(len(t.batch_ms[way]))]
        if failed := self.take_failed_loads():  # what get_transfer_results did not take (vLLM 0.26)
            delta[FAILED_REQUESTS] = sorted(failed)
        held = {"held_bytes_cpu": self.store.cpu_bytes_used(), "held_bytes_disk": self.store.disk_bytes_used(),
                "held_bytes_hbm": self.engine_kv.held_bytes if self.engine_kv is not None else 0}
        for name, nbytes in held.items():
            if self._held_reported.get(name) != nbytes:  # a gauge travels only when it moved
                delta[name] = {str(self.rank): nbytes}
        self._held_reported = held
        shared = self.store.shared_stats() if self.store is not None else {}
        last_shared, self._shared_reported = self._shared_reported, shared
        for field, name in SHARED_STATS_FIELDS.items():
            if field in shared:
                delta[name] = shared[field] - last_shared.get(field, 0)
        return delta if any(delta.values()) else None

    def settle(self, timeout_s: float = 30.0) -> bool:
        """See :meth:`WorkerNode.settle` (tests and benches)."""
        return self.node is None or self.node.settle(timeout_s)

    def close(self) -> None:
        if self.node is not None:
            self.node.close()


def _vllm_version() -> str:
    """The running vLLM's release, without importing vLLM (this half also runs in tests and benches)."""
    return getattr(sys.modules["vllm"], "__version__", "unknown") if "vllm" in sys.modules else "(not loaded)"
