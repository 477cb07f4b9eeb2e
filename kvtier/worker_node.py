"""kvtier on one engine worker rank, whatever the engine: a :class:`WorkerNode` owns the rank's store, one
:class:`TierWorker` per KV cache group, its hold reporter and, on rank 0, the lookup server that answers for every
rank; for P/D its publish holds, chunk server, engine KV and NIXL start. An engine adapter derives the layouts from
its own KV tensors and hands them over (vLLM's: :mod:`kvtier.engines.vllm.worker_side`); nothing here imports an
engine.

Commit protocol: each rank reports to rank 0 the storage keys it holds, whenever that changes (a save landed, a
chunk was evicted, removed, written to or dropped from disk, promoted from disk) and, at start, everything its
disk tier kept from a previous run. A chunk a save finds stored already (a local prefix hit's prompt is saved
again) is not reported again, unless a report of this rank was ever dropped. Rank 0 shows a chunk to lookups
only while every rank holds it (:mod:`kvtier.lookup.index`).

P/D: an engine that may prefill for others (``produce``) runs a chunk server per rank, pins what its requests
publish, and tells rank 0 its address (the scheduler hands it to decode engines). Any engine fetches a producer's
chunks when a load job says so.

Hybrid models: one layout and one :class:`TierWorker` per served KV cache group (its layers' tensors, its block
ids), over one store; jobs name their group. The groups' layouts share one fingerprint and one reuse guard (their
blocks come from one pool). A request's load ends when every group's job has; a failure is reported per request. P/D
serves and fetches every group's chunks, Mamba state too, between engines of one block size.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Callable

from kvtier.codec import chunk_bytes
from kvtier.config import KvtierConfig
from kvtier.jobs import LoadJob, Lend, SaveJob, StepPlan
from kvtier.layout import Layout
from kvtier.lookup import HoldReporter, LookupServer
from kvtier.ops import describe_backend
from kvtier.pd.engine_kv import EngineKv
from kvtier.pd.nixl import Agent
from kvtier.pd.nixl_start import NixlStart
from kvtier.pd.consumer.fetch import Consumer, FetchSpec, PeerError, PushMode
from kvtier.pd.consumer.gather import fetch_any_tp
from kvtier.pd.producer.holds import PublishHolds
from kvtier.pd.protocol import VERSION as PD_VERSION
from kvtier.pd.protocol import Hello
from kvtier.pd.producer.server import ChunkServer, ServedLayout
from kvtier.storage import ChunkStore, StoreConfig
from kvtier.transfer import TierWorker
from kvtier.transfer.promote import FAST_READERS, Promoter, beside_loads

logger = logging.getLogger(__name__)

Listener = Callable[[list[bytes]], None]  # hears the storage keys whose tiers changed (any thread, under a tier's lock)


class WorkerNode:
    """Everything kvtier runs on one worker rank, started in the constructor; :meth:`close` stops it all, in
    reverse order. The engine's KV memory stays the engine's: the node only copies blocks in and out of it.

    ``layouts``: one per served KV cache group, the anchor (the group lookups run on) first, all of one fingerprint.
    ``chunk_blocks``: per layout, the engine blocks one chunk of that group stores (the anchor's: ``chunk_tokens //
    block_size``; a Mamba state group in align mode: 1). ``endpoint``: rank 0's lookup socket (every rank reports
    there). ``produce``: serve this engine's chunks to decode engines (P/D). ``load_inline``: local-tier loads on the
    engine's thread (see :class:`TierWorker`). ``engine``: the engine and its release, for the start-up line.
    ``listen``: called once with the new store before anything is watched; what it returns hears every change of the
    keys this rank holds, after rank 0's reporter (an engine's KV cache events). ``began``: ``time.perf_counter()``
    when the engine's registration began (the start-up line counts from it; default: now).
    """

    def __init__(self, config: KvtierConfig, layouts: list[Layout], chunk_blocks: tuple[int, ...], *, rank: int,
                 world_size: int, endpoint: str, produce: bool = True, load_inline: bool = False,
                 engine: str = "an engine", listen: Callable[[ChunkStore], Listener] | None = None,
                 began: float | None = None):
        if not layouts or len(chunk_blocks) != len(layouts):
            raise ValueError(f"a worker node needs one layout per served KV cache group and one blocks-per-chunk "
                             f"figure for each: {len(layouts)} layouts, {len(chunk_blocks)} figures.")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.endpoint = endpoint
        self.produce = produce
        self.load_inline = load_inline
        self.store: ChunkStore | None = None
        self.server: LookupServer | None = None  # rank 0 only
        self.reporter: HoldReporter | None = None
        self.hello: Hello | None = None  # what this rank tells a producer it fetches from
        self.holds: PublishHolds | None = None
        self.group_transfers: list[TierWorker] = []  # one per served group, the anchor's first
        self.transfers: TierWorker | None = None  # the anchor group's
        self.promoter: Promoter | None = None  # with a disk tier: reads chunks a plan left on disk into CPU
        self.chunk_server: ChunkServer | None = None  # a producer's only
        self.engine_kv: EngineKv | None = None  # P/D HBM to HBM (one KV cache group only)
        self.nixl_start: NixlStart | None = None
        self._heard: Listener | None = None
        self._parts: dict[str, list] = {}  # hybrid: request -> [jobs not finished, failed, {group: block ids}]
        self._failed_requests: list[str] = []
        self._failed: set[int] = set()  # failed block ids, reported with the same step's finished loads
        self._unkept: set[str] = set()  # lends this rank cannot keep: their blocks go at once
        try:
            self._start(layouts, chunk_blocks, engine, listen, time.perf_counter() if began is None else began)
        except BaseException:
            self.close()  # what started before the failure
            raise

    def _start(self, layouts: list[Layout], chunk_blocks: tuple[int, ...], engine: str,
               listen: Callable[[ChunkStore], Listener] | None, begin: float) -> None:
        layout, config = layouts[0], self.config
        disk_path, shard = config.disk_path, layout.shard
        if disk_path and self.world_size > 1 and shard is None:
            disk_path = f"{disk_path}/rank{self.rank}"
        if shard is not None and shard.replicated and self.world_size > 1 and self.rank == 0:
            logger.info("kvtier: this KV is the same on every TP rank (MLA): the disk and shared tiers keep one "
                        "copy, rank 0's; the CPU tier one in each of the %d ranks, %d bytes each (cpu_bytes).",
                        self.world_size, config.cpu_bytes)
        # Pieces keyed by KV heads: one directory and namespace for every rank and TP size (see kvtier.shards).
        self.store = store = ChunkStore(StoreConfig(
            cpu_bytes=config.cpu_bytes, disk_path=disk_path, disk_bytes=config.disk_bytes,
            namespace=(layout.fingerprint if shard is None else shard.base).hex(),
            worker_id=self.rank if shard is None else 0, world_size=self.world_size if shard is None else 1,
            o_direct=config.disk_io == "direct", shared_url=config.shared_url,
            shared_timeout_ms=config.shared_timeout_ms, write_through=shard is None or not shard.replicated or
            self.rank == 0,  # MLA: one rank writes the disk and shared copy every rank reads
        ))
        tier_s = time.perf_counter() - begin  # LMCache's StorageManager: its CPU pool pinned
        if self.rank == 0:  # bound before any reporter connects, so none waits for a reconnect
            shared = None if config.shared_url is None else self._shared_prefix
            load_ms = lambda: {} if self.transfers is None else self.transfers.chunk_load_ms()  # noqa: E731
            probed = lambda: [] if self.transfers is None else self.transfers.probed_tiers()  # noqa: E731
            self.server = LookupServer(self.endpoint, self.world_size, load_ms, shared, probed)

        def tier_of(key: bytes) -> str | None:
            tier = store.contains(key)
            return None if tier is None else tier.value

        self.reporter = HoldReporter(self.endpoint, self.rank, self.world_size, layout.fingerprint, tier_of,
                                     *(() if shard is None or shard.replicated else
                                       (shard.base, (shard.first, shard.end, shard.total))))
        if listen is not None:
            self._heard = listen(store)
        store.watch(self._changed)
        backlog = config.save_backlog_bytes or config.cpu_bytes // 2
        self.hello = Hello(PD_VERSION, self.rank, self.world_size, layout.fingerprint, layout.description,
                           config.chunk_tokens)
        self.holds = PublishHolds(store.get, config.pd_hold_bytes or config.cpu_bytes // 4, config.pd_hold_s)

        def held(keys: list[bytes]) -> None:
            self._changed(keys)
            self.holds.stored(keys)

        def found(keys: list[bytes]) -> None:  # a save found them stored: the index has them already
            self.reporter.reaffirm(keys)
            self.holds.stored(keys)

        if layout.device.type == "cuda":  # nothing compiles while an engine starts (Triton until a build exists)
            from kvtier.ops import cuda_ops

            cuda_ops.allow_build(False)
        hybrid = len(layouts) > 1  # then every group's saves yield to any group's loads
        loads_running = (lambda: sum(t.loads.running() for t in self.group_transfers)) if hybrid else None
        cb = chunk_blocks[0]
        self.transfers = TierWorker(layout, store, cb, save_backlog_bytes=backlog, on_held=held, on_found=found,
                                    fetch_remote=self._fetch_remote, load_inline=self.load_inline, defer_reuse=True,
                                    on_lost=self.holds.lost, loads_running=loads_running)
        self.group_transfers = [self.transfers, *(
            TierWorker(other, store, blocks, save_backlog_bytes=backlog, on_held=held, on_found=found,
                       fetch_remote=self._fetch_remote, load_inline=self.load_inline, defer_reuse=True,
                       on_lost=self.holds.lost, reuse=self.transfers.reuse, loads_running=loads_running)
            for other, blocks in zip(layouts[1:], chunk_blocks[1:]))]
        # Measured before the first lookup is answered, so that it already carries the disk's figure.
        disk = store.disk_read_speed() if disk_path else None
        if disk_path:  # half the CPU tier at most, after every save (and load, unless the disk has room for both)
            yields_to_loads = not beside_loads(disk)
            self.promoter = Promoter(store, self.transfers.chunk_bytes, config.cpu_bytes // 2, lambda: any(
                (yields_to_loads and t.loads.running()) or t.pending_save_bytes() for t in self.group_transfers),
                readers=1 if yields_to_loads else FAST_READERS)
        if disk is not None:
            self.transfers.seed_read_speed("disk", disk.bytes_per_s)
        pd = "no P/D chunk server (kv_consumer)"
        if self.produce:
            bind, advertised = config.pd_endpoints(self.rank)
            served = ServedLayout(layout.fingerprint, layout.description, config.chunk_tokens, self.world_size,
                                  () if hybrid else layout.token_bytes,  # hybrid: one block size, no re-cut
                                  None if hybrid or layout.shard is None else layout)
            self.chunk_server = ChunkServer(bind, store, self.holds, served, self.transfers.saving, config.secret,
                                            config.pd_timeout_ms)
            pd = f"P/D chunk server at {advertised.rsplit(':', 1)[0]}:{self.chunk_server.port}"
            self.reporter.advertise(f"{advertised.rsplit(':', 1)[0]}:{self.chunk_server.port}")
        if not hybrid:
            lease_ms = config.pd_hbm_lease_ms if self.produce else 0
            self.engine_kv = EngineKv(layout, cb, lease_ms, config.pd_timeout_ms / 1000)
        self.nixl_start = NixlStart(self.rank, store.pool_memory(), self.engine_kv, self.chunk_server,
                                    self.transfers.loads.accept_landings, config.secret)
        pd += self.nixl_start.start(config.pd_transport)
        kept = store.keys()  # what a previous run left in the disk tier
        self.reporter.changed(kept)
        logger.info("kvtier rank %d/%d on %s: %d regions in %d KV cache group(s), %d B per block, chunk of %d "
                    "tokens, copies by %s, %d chunks kept on disk%s; lookup at %s; %s; started in %.1f s (CPU tier "
                    "%.1f s)", self.rank, self.world_size, engine, sum(len(x.regions) for x in layouts),
                    len(layouts), sum(x.bytes_per_block for x in layouts), config.chunk_tokens, describe_backend(
                        self.transfers.backend), len(kept), "" if disk is None else f", disk reads {disk.describe()}",
                    self.endpoint, pd, time.perf_counter() - begin, tier_s)

    def nixl_ready(self, timeout_s: float = 30.0) -> bool:
        """Wait until NIXL is up (True), or is not to be used here (False)."""
        return self.nixl_start is not None and self.nixl_start.ready(timeout_s)

    @property
    def nixl(self) -> Agent | None:
        """This rank's NIXL agent, once up with the CPU pool registered (benches set None for ZMQ, then set it back)."""
        return self.nixl_start.agent if self.nixl_start is not None else None

    @nixl.setter
    def nixl(self, agent: Agent | None) -> None:
        self.nixl_start.agent = agent

    def _changed(self, keys: list[bytes]) -> None:
        self.reporter.changed(keys)
        if self._heard is not None:
            self._heard(keys)

    def _fetch_remote(self, job: LoadJob, items: list[tuple[bytes, int]], targets: list[tuple[int, ...] | None]):
        remote = job.remote
        hybrid = len(self.group_transfers) > 1
        if hybrid and len(remote.endpoints) != self.world_size:
            raise PeerError(f"the producer has {len(remote.endpoints)} TP ranks, this engine (several KV cache "
                            f"groups) {self.world_size}")
        transfers = self.group_transfers[job.group]  # a hybrid's engines share one block size: chunks as stored
        allocate = lambda n: self.store.allocate(n, wait=False)  # noqa: E731
        return fetch_any_tp(Consumer(self.hello, self.config.pd_timeout_ms, self.config.secret, allocate,
                                     lambda n: chunk_bytes(transfers.layout, n), self.nixl,
                                     0 if hybrid else transfers.layout.block_size, PushMode(self.config.pd_hbm_push)),
                            transfers.layout, remote.endpoints,
                            FetchSpec("", remote.transfer_id, items, remote.wait,
                                      self.engine_kv.landing(targets) if self.engine_kv and self.nixl else None,
                                      remote.blocks if not hybrid else (), lambda: transfers.cancelled(job.req_id)),
                            allocate, transfers.loads.scatters_pieces)

    def _shared_prefix(self, chunks: list[tuple[bytes, ...]], fingerprints: tuple[bytes, ...]) -> int:
        """Leading ``chunks`` the shared tier holds for every rank (rank r's store namespace is its
        layout fingerprint), asked within half the scheduler's lookup timeout."""
        timeout_ms = min(self.config.shared_timeout_ms, self.config.lookup_timeout_ms // 2)
        shard = self.transfers.layout.shard  # pieces: every rank's store has the namespace of the base fingerprint
        return self.store.shared_prefix(chunks, tuple((fp if shard is None else shard.base).hex()
                                                      for fp in fingerprints), timeout_ms)

    def guard_reuse(self, plan: StepPlan) -> None:
        """Before a step's kernels: its given-out blocks wait for saves still reading them (see
        :meth:`TierWorker.guard_reuse`); aborted or preempted producers (``plan.stopped``) lend none."""
        self.transfers.guard_reuse(plan.allocated)
        if plan.stopped and self.engine_kv is not None and self.engine_kv.leases is not None:
            self.engine_kv.leases.stopped(plan.stopped)

    def start_loads(self, jobs: tuple[LoadJob, ...], cancels: tuple[str, ...] = (), busy: bool = False,
                    promotes: tuple[bytes, ...] = ()) -> None:
        """Cancel the loads of requests ``cancels``, then start ``jobs`` (``busy``: the step computes other requests,
        so no load runs on the engine's thread); queue the chunks of chain keys ``promotes`` to be read from disk into
        the CPU tier once no load or save runs."""
        if promotes and self.promoter is not None:
            self.promoter.submit(self.transfers.skey(key) for key in promotes)
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
        the interpreter left to the transfer threads (an engine's loop would spin through such steps)."""
        if not (self.transfers is not None and self.transfers.wait_finished(timeout_s)) and self.engine_kv is not None:
            self.engine_kv.wait_ended(timeout_s)

    def finished_sends(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose blocks the engine may free now (their lease ended, or none could be kept)."""
        unkept, self._unkept = self._unkept, set()
        return unkept | (self.engine_kv.ended(finished_req_ids) if self.engine_kv is not None else set())

    def save(self, jobs: tuple[SaveJob, ...]) -> None:
        """After the forward: copy out each group's chunks of ``jobs`` (published ones pinned first)."""
        after = self.engine_kv.saving(jobs) if self.engine_kv is not None else None  # a producer's checksums
        for job in jobs:
            if job.publish is not None:  # announced before the save can land, so it is pinned
                self.holds.announce(job.publish, [self.transfers.skey(k) for k in job.keys], job.final)
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

    def storing(self) -> bool:
        """Whether chunks are still being stored or written to disk (their changes are still to come)."""
        return any(t.pending_save_bytes() > 0 for t in self.group_transfers) or self.store.disk_writes_pending()

    def finished_loads(self) -> set[str]:
        """Requests whose load ended since the last call (a hybrid's: once every group's job has); failures go to
        :meth:`failed_blocks` (one group) or :meth:`take_failed_loads` (several)."""
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
        """Requests whose load failed as a whole (a hybrid model's), each once."""
        failed, self._failed_requests = set(self._failed_requests), []
        return failed

    def failed_blocks(self) -> set[int]:
        """Block ids whose load failed (one group's model), each once: the engine recomputes them."""
        failed, self._failed = self._failed, set()
        return failed

    def settle(self, timeout_s: float = 30.0) -> bool:
        """Wait for every load and save, then (False after ``timeout_s`` s) for tier writes and rank
        0 to hear of them: the next lookup sees every save (tests and benches)."""
        for transfers in self.group_transfers:
            transfers.drain()
        landed = self.store is None or self.store._flush(timeout_s)
        return (self.reporter is None or self.reporter.flush(timeout_s)) and landed

    def close(self) -> None:
        """Stop everything, the last started first; pending saves finish and still report."""
        if self.nixl_start is not None:
            self.nixl_start.ready(30)
        for part in (self.chunk_server, self.holds):
            if part is not None:
                part.close()
        if self.promoter is not None:
            self.promoter.close()
        for transfers in self.group_transfers:
            transfers.close()  # finishes pending saves, which still report
        if self.store is not None:
            self.store.watch(None)
        for part in (self.reporter, self.server, self.engine_kv):
            if part is not None:
                part.close()
        if self.store is not None:
            if self.nixl_start is not None:
                self.nixl_start.close()
            self.store.close()
        self.server = self.transfers = self.store = self.reporter = self.chunk_server = self.holds = self.promoter = None
        self.group_transfers = []
