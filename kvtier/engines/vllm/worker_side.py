"""Worker half of the vLLM connector: per worker process a store, a :class:`TierWorker` and a hold reporter; on rank 0
also the lookup server that answers for every rank.

Commit protocol: each rank reports to rank 0 the storage keys it holds, whenever that changes (a save landed, a
chunk was found already stored, evicted, removed, written to or dropped from disk, promoted from disk) and, at
start, everything its disk tier kept from a previous run. Rank 0 shows a chunk to lookups only while every rank
holds it (:mod:`kvtier.lookup.index`).

P/D: an engine that may prefill for others (``kv_both`` / ``kv_producer``) runs a chunk server per rank, pins what
its requests publish, and tells rank 0 its address (the scheduler hands it to decode engines). Any engine fetches a
producer's chunks when a load job says so.

Hybrid models: one layout and one :class:`TierWorker` per served KV cache group (its layers' tensors, its block
ids), over one store; jobs name their group. The groups' layouts share one fingerprint and one reuse guard (their
blocks come from one pool). A request's load ends when every group's job has; a failure is reported per request. P/D
serves and fetches every group's chunks, Mamba state too, between engines of one block size.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import sys
import time
from typing import TYPE_CHECKING

import torch

from kvtier.config import KvtierConfig
from kvtier.engines.vllm.groups import blocks_per_chunk, group_layouts
from kvtier.engines.vllm.stats import FAILED_REQUESTS
from kvtier.jobs import LoadJob, Lend, SaveJob, StepPlan
from kvtier.codec import chunk_bytes
from kvtier.lookup import HoldReporter, LookupServer
from kvtier.ops import describe_backend
from kvtier.pd.engine_kv import EngineKv
from kvtier.pd.nixl import Agent
from kvtier.pd.nixl_start import NixlStart
from kvtier.pd.consumer.fetch import Consumer, FetchSpec, PeerError, PushMode, fetch_chunks
from kvtier.pd.producer.holds import PublishHolds
from kvtier.pd.protocol import VERSION as PD_VERSION, Hello
from kvtier.pd.producer.server import ChunkServer, ServedLayout
from kvtier.storage import ChunkStore, StoreConfig
from kvtier.transfer import TierWorker, TransferStats

if TYPE_CHECKING:
    from kvtier.engines.vllm.events import TierEvents

logger = logging.getLogger(__name__)

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
}
# ChunkStore.shared_stats() field -> name in the connector stats (per rank: each writes its shard).
SHARED_STATS_FIELDS = {"writes": "shared_writes", "dropped_writes": "shared_dropped_writes",
                       "failed_writes": "shared_failed_writes"}
_RANK0_ONLY = ("cpu_hit_tokens", "disk_hit_tokens", "remote_hit_tokens", "shared_hit_tokens")  # every rank loads the same tokens


class WorkerSide:
    """Owns this worker's store, transfer worker, reporter and (rank 0) lookup server; closes all."""

    def __init__(self, config: KvtierConfig, model: str, block_size: int, num_blocks: int, endpoint: str,
                 rank: int, world_size: int, produce: bool = True, kv_events: bool = False, load_inline: bool = False,
                 groups: tuple[tuple[str, int, tuple[str, ...]], ...] = ()):
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
        self.group_transfers: list[TierWorker] = []  # one per served group, the anchor's first
        self._parts: dict[str, list] = {}  # hybrid: request -> [jobs not finished, failed, {group: block ids}]
        self.holds: PublishHolds | None = None
        self.chunk_server: ChunkServer | None = None
        self._hello: Hello | None = None
        self.transfers: TierWorker | None = None
        self.store: ChunkStore | None = None
        self.server: LookupServer | None = None
        self.reporter: HoldReporter | None = None
        self._failed_requests: list[str] = []
        self._failed: set[int] = set()  # failed block ids, reported with the same step's finished loads
        self._reported = TransferStats()
        self._held_reported: dict[str, int] = {}  # held_bytes_<tier> as last reported
        self.events: TierEvents | None = None
        self._kv_events = kv_events and rank == 0  # one rank announces: every rank holds the same chunks
        self._shared_reported: dict[str, int] = {}
        self._nixl_start: NixlStart | None = None
        self.engine_kv: EngineKv | None = None  # P/D HBM to HBM (one KV cache group only)
        self._unkept: set[str] = set()  # lends this rank cannot keep: their blocks go at once

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        begin = time.perf_counter()
        layouts = group_layouts(kv_caches, self.groups, self.block_size, self.num_blocks, model=self.model,
                                tp_rank=self.rank, tp_size=self.world_size)
        layout = layouts[0]
        config = self.config
        disk_path = config.disk_path
        if disk_path and self.world_size > 1:
            disk_path = f"{disk_path}/rank{self.rank}"
        self.store = store = ChunkStore(StoreConfig(
            cpu_bytes=config.cpu_bytes, disk_path=disk_path, disk_bytes=config.disk_bytes,
            namespace=layout.fingerprint.hex(), worker_id=self.rank, world_size=self.world_size,
            o_direct=config.disk_io == "direct", shared_url=config.shared_url,
            shared_timeout_ms=config.shared_timeout_ms,
        ))
        tier_s = time.perf_counter() - begin  # LMCache's StorageManager: its CPU pool pinned
        if self.rank == 0:  # bound before any reporter connects, so none waits for a reconnect
            shared = None if config.shared_url is None else self._shared_prefix
            load_ms = lambda: {} if self.transfers is None else self.transfers.chunk_load_ms()  # noqa: E731
            self.server = LookupServer(self.endpoint, self.world_size, load_ms, shared)

        def tier_of(key: bytes) -> str | None:
            tier = store.contains(key)
            return None if tier is None else tier.value

        self.reporter = HoldReporter(self.endpoint, self.rank, self.world_size, layout.fingerprint, tier_of)
        if self._kv_events:
            from kvtier.engines.vllm.events import TierEvents  # imports vLLM: only where vLLM runs

            self.events = TierEvents(store.residency)
        store.watch(self._changed)
        backlog = config.save_backlog_bytes or config.cpu_bytes // 2
        self._hello = Hello(PD_VERSION, self.rank, self.world_size, layout.fingerprint, layout.description,
                            config.chunk_tokens)
        self.holds = PublishHolds(store.get, config.pd_hold_bytes or config.cpu_bytes // 4, config.pd_hold_s)

        def held(keys: list[bytes]) -> None:
            self._changed(keys)
            self.holds.stored(keys)

        if layout.device.type == "cuda":  # nothing compiles while an engine starts (Triton until a build exists)
            from kvtier.ops import cuda_ops

            cuda_ops.allow_build(False)
        hybrid = len(layouts) > 1  # then every group's saves yield to any group's loads
        loads_running = (lambda: sum(t.loads.running() for t in self.group_transfers)) if hybrid else None
        cb = config.chunk_tokens // self.block_size
        self.transfers = TierWorker(layout, store, cb, save_backlog_bytes=backlog, on_held=held,
                                    fetch_remote=self._fetch_remote, load_inline=self.load_inline, defer_reuse=True,
                                    on_lost=self.holds.lost, loads_running=loads_running)
        self.group_transfers = [self.transfers, *(
            TierWorker(other, store, blocks_per_chunk(kind, cb), save_backlog_bytes=backlog, on_held=held,
                       fetch_remote=self._fetch_remote, load_inline=self.load_inline, defer_reuse=True,
                       on_lost=self.holds.lost, reuse=self.transfers.reuse, loads_running=loads_running)
            for other, (kind, _, _) in zip(layouts[1:], self.groups[1:]))]
        pd = "no P/D chunk server (kv_consumer)"
        if self.produce:
            bind, advertised = config.pd_endpoints(self.rank)
            served = ServedLayout(layout.fingerprint, layout.description, config.chunk_tokens, self.world_size,
                                  () if hybrid else layout.token_bytes)  # hybrid: one block size, no re-cut
            self.chunk_server = ChunkServer(bind, store, self.holds, served, self.transfers.saving, config.secret,
                                            config.pd_timeout_ms)
            pd = f"P/D chunk server at {advertised.rsplit(':', 1)[0]}:{self.chunk_server.port}"
            self.reporter.advertise(f"{advertised.rsplit(':', 1)[0]}:{self.chunk_server.port}")
        if not hybrid:
            lease_ms = config.pd_hbm_lease_ms if self.produce else 0
            self.engine_kv = EngineKv(layout, cb, lease_ms, config.pd_timeout_ms / 1000)
        self._nixl_start = NixlStart(self.rank, store.pool_memory(), self.engine_kv, self.chunk_server,
                                     self.transfers.loads.accept_landings, config.secret)
        pd += self._nixl_start.start(config.pd_transport)
        kept = store.keys()  # what a previous run left in the disk tier
        self.reporter.changed(kept)
        logger.info("kvtier rank %d/%d on vLLM %s: %d regions in %d KV cache group(s), %d B per block, chunk of %d "
                    "tokens, copies by %s, %d chunks kept on disk; lookup at %s; %s; started in %.1f s (CPU tier "
                    "%.1f s)", self.rank, self.world_size, _vllm_version(), sum(len(x.regions) for x in layouts),
                    len(layouts), sum(x.bytes_per_block for x in layouts), config.chunk_tokens, describe_backend(
                        self.transfers.backend), len(kept), self.endpoint, pd, time.perf_counter() - begin, tier_s)

    def nixl_ready(self, timeout_s: float = 30.0) -> bool:
        """Wait until NIXL is up (True), or is not to be used here (False)."""
        return self._nixl_start is not None and self._nixl_start.ready(timeout_s)

    @property
    def nixl(self) -> Agent | None:
        """This rank's NIXL agent, once up with the CPU pool registered (benches set None for ZMQ, then set it back)."""
        return self._nixl_start.agent if self._nixl_start is not None else None

    @nixl.setter
    def nixl(self, agent: Agent | None) -> None:
        self._nixl_start.agent = agent

    def _changed(self, keys: list[bytes]) -> None:
        self.reporter.changed(keys)
        if self.events is not None:
            self.events.changed(keys)

    def _fetch_remote(self, job: LoadJob, items: list[tuple[bytes, int]], targets: list[tuple[int, ...] | None]):
        remote = job.remote
        if len(remote.endpoints) != self.world_size:
            raise PeerError(f"the producer has {len(remote.endpoints)} TP ranks, this engine {self.world_size}")
        transfers = self.group_transfers[job.group]  # a hybrid's engines share one block size: chunks as stored
        return fetch_chunks(Consumer(self._hello, self.config.pd_timeout_ms, self.config.secret,
                                     lambda n: self.store.allocate(n, wait=False),
                                     lambda n: chunk_bytes(transfers.layout, n), self.nixl,
                                     0 if len(self.group_transfers) > 1 else transfers.layout.block_size,
                                     PushMode(self.config.pd_hbm_push)),
                            FetchSpec(remote.endpoints[self.rank], remote.transfer_id, items, remote.wait,
                                      self.engine_kv.landing(targets) if self.engine_kv and self.nixl else None,
                                      remote.blocks if len(self.group_transfers) == 1 else (),
                                      lambda: transfers.cancelled(job.req_id)))

    def _shared_prefix(self, chunks: list[tuple[bytes, ...]], fingerprints: tuple[bytes, ...]) -> int:
        """Leading ``chunks`` the shared tier holds for every rank (rank r's store namespace is its
        layout fingerprint), asked within half the scheduler's lookup timeout."""
        timeout_ms = min(self.config.shared_timeout_ms, self.config.lookup_timeout_ms // 2)
        return self.store.shared_prefix(chunks, tuple(fp.hex() for fp in fingerprints), timeout_ms)

    def guard_reuse(self, plan: StepPlan) -> None:
        """Before a step's kernels: its given-out blocks wait for saves still reading them (see
        :meth:`TierWorker.guard_reuse`); aborted or preempted producers (``plan.stopped``) lend none."""
        self.transfers.guard_reuse(plan.allocated)
        if plan.stopped and self.engine_kv is not None and self.engine_kv.leases is not None:
            self.engine_kv.leases.stopped(plan.stopped)

    def start_loads(self, jobs: tuple[LoadJob, ...], cancels: tuple[str, ...] = (), busy: bool = False) -> None:
        for req_id, transfers in itertools.product(cancels, self.group_transfers):
            transfers.cancel(req_id)
        if len(self.group_transfers) > 1:
            for job in jobs:  # counted first: an inline load reports before submit_load returns
                part = self._parts.setdefault(job.req_id, [0, False, {}])
                part[0], part[2][job.group] = part[0] + 1, frozenset(job.block_ids)
        for job in jobs:
            self.group_transfers[job.group].submit_load(job, busy)

    def announce(self, jobs: tuple[SaveJob, ...], withdrawn: tuple[str, ...] = ()) -> None:
        """Before the forward: published requests this step computes are alive (a waiting decode
        engine gets heartbeats through a long prefill step) and their chunks are coming; those
        ``withdrawn`` were aborted (what was published stays, the rest is missing at once)."""
        for transfer_id in withdrawn:
            self.holds.withdraw(transfer_id)
        for job in jobs:
            if job.publish is not None:
                self.holds.announce(job.publish, [self.transfers.skey(k) for k in job.keys], False)

    def lend(self, lends: tuple[Lend, ...]) -> None:
        """Keep finished producer requests' blocks for decode engines (see :mod:`kvtier.pd.engine_kv`)."""
        if lends and self.engine_kv is not None and self.engine_kv.lend(lends):
            self.holds.changed.set()  # a fetch waiting for its lease looks again
        elif lends:
            self._unkept.update(lend.req_id for lend in lends)

    def wait_idle(self, timeout_s: float) -> None:
        """A step that computes nothing: wait up to ``timeout_s`` for a load, else a lease, to end,
        the interpreter left to the transfer threads (vLLM's loop would spin through such steps)."""
        if not (self.transfers is not None and self.transfers.wait_finished(timeout_s)) and self.engine_kv is not None:
            self.engine_kv.wait_ended(timeout_s)

    def finished_sends(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose blocks vLLM may free now (their lease ended)."""
        unkept, self._unkept = self._unkept, set()
        return unkept | (self.engine_kv.ended(finished_req_ids) if self.engine_kv is not None else set())

    def save(self, jobs: tuple[SaveJob, ...]) -> None:
        after = self.engine_kv.saving(jobs) if self.engine_kv is not None else None  # a producer's checksums
        for job in jobs:
            if job.publish is not None:  # announced before the save can land, so it is pinned
                self.holds.announce(job.publish, [self.transfers.skey(k) for k in job.keys], job.final)
        if self.events is not None:
            for job in jobs:
                for key, name in zip(job.keys, job.names):
                    if name is not None:
                        self.events.name(self.transfers.skey(key), name)
        pushing = self.chunk_server is not None and self.chunk_server.pushing  # see SaveSide.save
        for group, transfers in enumerate(self.group_transfers):
            if mine := [job for job in jobs if job.keys and job.group == group]:
                transfers.save(mine, pushing, after)

    def reset(self) -> int:
        """Empty this rank's tiers: saves already queued land first, then every chunk of this
        layout's namespace goes from CPU and disk (the index hears of each). Returns how many."""
        for transfers in self.group_transfers:
            transfers.wait_saved()
        keys = self.store.keys()
        for key in keys:
            self.store.remove(key)
        logger.info("kvtier rank %d: cache reset, %d chunks removed", self.rank, len(keys))
        return len(keys)

    def take_events(self) -> tuple[list, bool]:
        """KV cache events since the last call (rank 0 only; none elsewhere), and whether more
        are on their way (chunks still being stored or written to disk)."""
        if self.events is None:
            return [], False
        settling = any(t.pending_save_bytes() > 0 for t in self.group_transfers) or self.store.disk_writes_pending()
        return self.events.take(), settling

    def finished_loads(self) -> set[str]:
        if self.transfers is None:
            return set()
        if len(self.group_transfers) == 1:
            req_ids, failed = self.transfers.take_finished()
            self._failed |= failed
            return req_ids
        done = set()
        for group, transfers in enumerate(self.group_transfers):
            req_ids, failed = transfers.take_finished()
            for req_id in req_ids:
                part = self._parts[req_id]
                part[0] -= 1
                part[1] |= not failed.isdisjoint(part[2].pop(group, ()))
                if part[0] == 0:
                    del self._parts[req_id]
                    done.add(req_id)
                    if part[1]:
                        self._failed_requests.append(req_id)
        return done

    def take_failed_loads(self) -> set[str]:
        """Requests whose load failed as a whole (a hybrid model's), each once: vLLM's failed receives."""
        failed, self._failed_requests = set(self._failed_requests), []
        return failed

    def failed_blocks(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

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
        """Wait for every load and save, then (False after ``timeout_s`` s) for tier writes and rank
        0 to hear of them: the next lookup sees every save (tests and benches)."""
        for transfers in self.group_transfers:
            transfers.drain()
        landed = self.store is None or self.store._flush(timeout_s)
        return (self.reporter is None or self.reporter.flush(timeout_s)) and landed

    def close(self) -> None:
        if self._nixl_start is not None:
            self._nixl_start.ready(30)
        for part in (self.chunk_server, self.holds):
            if part is not None:
                part.close()
        for transfers in self.group_transfers:
            transfers.close()  # finishes pending saves, which still report
        if self.store is not None:
            self.store.watch(None)
        for part in (self.reporter, self.server, self.engine_kv):
            if part is not None:
                part.close()
        if self.store is not None:
            if self._nixl_start is not None:
                self._nixl_start.close()
            self.store.close()
        self.server = self.transfers = self.store = self.reporter = self.chunk_server = self.holds = None
        self.group_transfers = []


def _vllm_version() -> str:
    """The running vLLM's release, without importing vLLM (this half also runs in tests and benches)."""
    return getattr(sys.modules["vllm"], "__version__", "unknown") if "vllm" in sys.modules else "(not loaded)"
