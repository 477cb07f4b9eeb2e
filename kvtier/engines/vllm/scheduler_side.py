"""Scheduler half of the vLLM connector: look up stored prefixes, plan loads and saves, track states.

Decisions are :mod:`kvtier.scheduler_hooks`' pure functions; this module feeds them what vLLM knows and turns their
plans into :class:`LoadJob` / :class:`SaveJob`. Calls come from the connector (admission, allocation, metadata,
worker output, finish) and, when it is installed, from :class:`kvtier.engines.vllm.scheduler.KvtierScheduler`
(handoff boundary, step times). The module is one piece: each of those calls reads and advances the same per-request
records (:class:`~kvtier.engines.vllm.records.Tracked`) and step counters, which nothing else may change, and every
decision in it is already a pure function in :mod:`kvtier.scheduler_hooks`.

Hybrid models (several served KV cache groups, :mod:`.groups`): lookups, plans and states run on the anchor group's
chunks; how far the other groups hold a hit, and their loads and saves beside the anchor's, are
:class:`~kvtier.engines.vllm.group_jobs.GroupJobs`' (:mod:`.group_jobs`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, Iterator, Sequence

from kvtier.config import KvtierConfig
from kvtier.engines.vllm.group_jobs import GroupJobs
from kvtier.engines.vllm.groups import ServedGroup
from kvtier.engines.vllm.records import PlannedLoad, Tracked
from kvtier.jobs import ChunkBlocks, LoadJob, RemoteSource, SaveJob, StepPlan
from kvtier.keys import chunk_keys, namespace, tail_key
from kvtier.lookup import LookupClient
from kvtier.pd import params as pd
from kvtier.scheduler_hooks import (
    CostMeter, Event, Geometry, LoadPlan, PlanInput, PlanKind, Policy, ReqState, advance, may_load, plan_load, tier_tokens,
)
from kvtier.scheduler_hooks.cost import StepTimer
from kvtier.scheduler_hooks.distrust import Distrusted

logger = logging.getLogger(__name__)

PROBE_EVERY = 32  # after this many loads vetoed on cost in a row, one loads anyway to re-measure


class SchedulerSide:
    """Turns vLLM scheduler events into :class:`StepPlan` s. Block ids are the served KV cache group's.

    ``clock``: seconds, monotonic; tests replace it to make measured costs deterministic.
    ``name_chunk(req_id, chunk)``: the engine's names for a request's chunk's blocks, given when
    the engine publishes KV cache events (saved chunks then carry them to the workers).
    ``groups``: the served KV cache groups of a hybrid model, the anchor first (block ids without
    a group are the anchor's); empty or one: the engine's one group.
    """

    def __init__(self, config: KvtierConfig, model: str, block_size: int, endpoint: str,
                 clock: Callable[[], float] = time.perf_counter, engine_id: str = "", tp_size: int = 1,
                 name_chunk: Callable[[str, int], ChunkBlocks | None] | None = None,
                 groups: tuple[ServedGroup, ...] = ()):
        self.config, self.model, self.block_size = config, model, block_size
        self.geometry = Geometry(block_size, config.chunk_tokens)
        self.groups = GroupJobs(groups, self.geometry)
        self.chunk_tokens, self.chunk_blocks = config.chunk_tokens, self.geometry.chunk_blocks
        self.policy = Policy(config.min_load_tokens or config.chunk_tokens, config.unaligned, False, not self.groups.others)
        self.meter = CostMeter(config.prefill_tokens_per_s)
        self.steps = StepTimer(self.meter, clock)  # the connector times every step for the cost model
        self.clock, self.client = clock, LookupClient(endpoint, config.lookup_timeout_ms)
        self.engine_id, self.tp_size, self.name_chunk = engine_id, tp_size, name_chunk
        self.reset_pending = False  # reset_cache() was asked; the workers have not emptied the tiers yet
        self._reset_step: int | None = None  # the step whose plan carries the reset
        self.peer_endpoints: list[str] = []  # this engine's P/D chunk servers, as rank 0 last told
        self._requests: dict[str, Tracked] = {}
        self._loads: list[PlannedLoad] = []  # planned this step, not yet in a StepPlan
        self._group_save_jobs: list[SaveJob] = []  # other served groups' saves planned this step
        self._load_failures: set[str] = set()  # hybrid: requests whose load failed, until reported finished
        # for the next plan: P/D loads to stop; transfers of producer requests aborted before publishing all;
        self._cancels, self._withdrawn, self._stopped, self._promotes = [], [], [], []  # ... of those aborted or preempted; keys to promote
        self._distrusted = Distrusted()
        self._step = self._completed = 0  # steps planned (StepPlans taken); steps whose output came back
        self.counts: Counter[str] = Counter()  # admissions by committed plan kind (and skip reason)
        self._warned_handoff, self._vetoes = False, 0  # (vetoes: admissions that left stored chunks on cost since a whole load)

    def enable_handoff(self, missing: tuple[str, ...] = ()) -> None:
        """kvtier's scheduler is installed: it can stop a prefill at a chunk boundary, unless this
        vLLM's scheduler lacks the methods it needs for that (``missing``). Not with Mamba state,
        which a step ending at the boundary would save there but no load brings back."""
        why = f"this vLLM's scheduler has no {', '.join(missing)}" if missing else \
            "handoffs are off for Mamba hybrids" if self.groups.state_groups else None
        if why is not None:
            if self.config.unaligned == "handoff":
                logger.warning("kvtier: %s; unaligned hits load partial chunks.", why)
            self._warned_handoff = True
            return
        self.policy = Policy(self.policy.min_load_tokens, self.policy.unaligned, True, self.policy.cut)

    # ---- admission --------------------------------------------------------------------------
    def track(self, req_id: str, prompt: list[int], cache_salt: str | None,
              transfer_params: dict | None = None) -> Tracked:
        tracked = self._requests.get(req_id)
        if tracked is None:
            root = namespace(self.model, cache_salt)
            keys = chunk_keys(prompt, self.chunk_tokens, root)
            role = pd.role_in(transfer_params, req_id)
            replies = self.config.save_replies and role is None and not self.groups.others
            tracked = self._requests[req_id] = Tracked(keys, len(prompt), root, replies)
            if role is not None:
                tracked.role, tracked.tail = role, tail_key(prompt, self.chunk_tokens, root, keys)
                tracked.transfer_id = role.transfer_id or req_id
        return tracked

    def matched_tokens(self, req_id: str, prompt: list[int], cache_salt: str | None, local_tokens: int,
                       transfer_params: dict | None = None) -> LoadPlan:
        """Plan the prompt's load given the engine's own ``local_tokens`` (block-aligned).

        Only remembers the plan for :meth:`allocated`; calling it again changes nothing else.
        A P/D consumer's plan covers the whole prompt: its own tiers' chunks, then the producer's.
        """
        tracked = self.track(req_id, prompt, cache_salt, transfer_params)
        producer = isinstance(tracked.role, pd.Produce) and not self.peer_endpoints  # must learn its chunk servers
        keys = tracked.keys if tracked.role or may_load(len(prompt), local_tokens, self.geometry, self.policy) else []
        reply = self.client.lookup(keys, always=producer)  # no load possible: no trip to rank 0
        if reply is not None and reply.chunk_load_ms:
            self.meter.record_chunk_load_ms(reply.chunk_load_ms, self.chunk_tokens, reply.probed)
        if reply is not None and reply.endpoints:
            self.peer_endpoints = reply.endpoints
        # Not until the workers emptied the tiers after a reset, nor after a failed load (see loads_reported).
        tiers = () if self.reset_pending or tracked.load_failed else \
            self._distrusted.trusted(tracked.keys, reply.tiers if reply is not None else [])
        tiers = tiers[: self.groups.held_chunks(tracked.keys, len(prompt), len(tiers), self.client.lookup)]
        remote = isinstance(tracked.role, pd.Consume) and not tracked.remote_failed and not tracked.load_failed
        if remote:
            tiers += ("remote",) * (len(tracked.keys) + (tracked.tail is not None) - len(tiers))
        inp = PlanInput(len(prompt), local_tokens, tiers, remote)
        costs = self.meter.model() if self.config.veto_slower_loads else None  # None: every hit loads
        plan = self.groups.remote_plan(plan_load(inp, self.geometry, self.policy, costs),
                                       len(prompt), local_tokens)
        if plan.cut_on_cost and self._vetoes >= PROBE_EVERY:
            # Chunks left on cost measure nothing: now and then a hit loads whole anyway, so a
            # cost model that went wrong (or a tier that got faster) is corrected.
            plan = plan_load(inp, self.geometry, self.policy, None)
        if self.config.unaligned == "handoff" and not self.policy.handoff_supported and not self._warned_handoff:
            logger.warning("kvtier setting unaligned='handoff' needs scheduler_cls='%s'; "
                           "loading partial chunks instead.", "kvtier.engines.vllm.scheduler.KvtierScheduler")
            self._warned_handoff = True
        tracked.plan, tracked.tiers, tracked.lookups = plan, tiers, tracked.lookups + 1
        return plan

    def allocated(self, req_id: str, block_ids: list[int], external_tokens: int,
                  others: tuple[list[int], ...] = ()) -> None:
        """Blocks are allocated at admission: commit the plan of the lookup just made (idempotent).
        ``others``: each other served group's blocks (hybrid models)."""
        tracked = self._requests.get(req_id)
        if tracked is None or tracked.plan is None:
            return  # a second call, or a request resuming after its load (no lookup)
        tracked.group_blocks = [list(ids) for ids in others]
        plan, tracked.plan, tracked.load_failed = tracked.plan, None, False
        if tracked.role is None:
            # What every rank's tiers hold needs no save (a local hit's or a load's chunks): the
            # workers would only find each stored again, a store look-up per chunk on the engine's
            # thread. A load that fails gives its chunks back to the save plan (loads_reported).
            stored = len(tracked.tiers) - tracked.tiers.count("remote")
            tracked.saved_chunks = max(tracked.saved_chunks, stored)
        if tracked.state is ReqState.RUNNING:
            # Admitted again after running: vLLM's own scheduler preempted it without telling the
            # connector (only kvtier's scheduler calls preempted()), so its state starts over here.
            self.preempted(req_id)
        self._vetoes = self._vetoes + 1 if plan.cut_on_cost else 0 if plan.skip is None else self._vetoes
        self._promotes += [] if self.groups.others else tracked.promotions(plan, self.geometry)
        if (plan.skip is not None or plan.cut_on_cost) and tracked.tiers:
            why = f"{plan.skip.name.lower()}: {plan.skip.value}" if plan.skip else "slower than recompute past it"
            logger.debug("kvtier: request %s loads nothing of %d stored chunks from token %d (%s)", req_id,
                         len(tracked.tiers), plan.load_end, why)
        if external_tokens == 0:
            kind = plan.kind if plan.kind is PlanKind.HANDOFF else PlanKind.NONE
            self.counts[kind.value if plan.skip is None else f"none: {plan.skip.name.lower()}"] += 1
            if kind is PlanKind.HANDOFF:
                tracked.handoff = plan
                self._advance(req_id, tracked, Event.HANDOFF)
            else:
                self._advance(req_id, tracked, Event.RECOMPUTE)
            return
        self.counts[plan.kind.value] += 1
        if plan.external_tokens == 0:
            raise RuntimeError(f"kvtier: request {req_id} was given {external_tokens} external tokens without a load plan")
        # vLLM may trim the external count (never extend it): load what it counts, block-aligned
        # (the whole prompt's blocks, the last partial one included, when it counts them all).
        end = min(plan.load_end, plan.load_start + external_tokens)
        if end < tracked.prompt_tokens:
            end -= end % self.block_size
        self._plan_job(req_id, tracked, plan.load_start, end, block_ids)
        self._advance(req_id, tracked, Event.LOAD)

    def prefill_cap(self, req_id: str, computed_tokens: int) -> int | None:
        """Most tokens the request may prefill from ``computed_tokens`` this step (None: no cap): a handoff's up to its
        chunk boundary; at admission, before the plan is committed, the latest plan for the same local hit's."""
        tracked = self._requests.get(req_id)
        if tracked is None:
            return None
        if tracked.state is ReqState.PREFILL_TO_BOUNDARY:
            return max(0, tracked.handoff.boundary - computed_tokens)
        plan = tracked.plan
        if tracked.state is ReqState.LOOKUP and plan is not None and plan.kind is PlanKind.HANDOFF \
                and plan.local_tokens == computed_tokens:
            return plan.boundary - computed_tokens
        return None

    def hit_sources(self, req_id: str) -> dict[str, int]:
        """Tokens of the planned load per tier name (``cpu`` / ``disk``)."""
        load = tracked.load if (tracked := self._requests.get(req_id)) else None
        if load is None:
            return {}
        end = min(load.start + len(load.job.block_ids) * self.block_size, tracked.prompt_tokens)
        return tier_tokens(load.tiers, load.start, end, self.chunk_tokens)

    # ---- handoff ------------------------------------------------------------------------------
    def handoffs(self) -> Iterator[tuple[str, LoadPlan]]:
        """Requests prefilling towards a chunk boundary, with their plans."""
        for req_id, tracked in self._requests.items():
            if tracked.state is ReqState.PREFILL_TO_BOUNDARY:
                yield req_id, tracked.handoff

    def park(self, req_id: str, block_ids: list[int], others: tuple[list[int], ...] = ()) -> None:
        """The handoff reached its boundary and holds blocks through the hit: load the rest.
        ``others``: each other served group's blocks (hybrid models)."""
        tracked = self._requests[req_id]
        tracked.group_blocks = [list(ids) for ids in others]
        plan, tracked.handoff = tracked.handoff, None
        self._plan_job(req_id, tracked, plan.load_start, plan.load_end, block_ids)
        self._advance(req_id, tracked, Event.PARK)

    def park_failed(self, req_id: str) -> None:
        """No blocks for the rest of the hit: the request prefills it instead."""
        tracked = self._requests[req_id]
        tracked.handoff = None
        self.counts["handoff_park_failed"] += 1
        self._advance(req_id, tracked, Event.PARK_FAILED)

    # ---- steps --------------------------------------------------------------------------------
    def scheduled(self, req_id: str, block_ids: list[int] | None, replace: bool, computed_after: int,
                  others: tuple[list[int], ...] = (), computed_before: int = 0, states=(),
                  tokens: Sequence[int] | None = None) -> SaveJob | None:
        """A request runs this step and will have ``computed_after`` tokens computed (``computed_before`` before it);
        new full chunks are saved: the prompt's, and with ``tokens`` (prompt and output so far) its reply's. ``block_ids``:
        blocks added this step (all of them if ``replace``); ``others``: the same for each other served group (hybrid
        models), whose save jobs join the step's plan (:meth:`take_plan`) beside the anchor's returned here; ``states``:
        the Mamba states this step writes (``compat.boundary_states``)."""
        tracked = self._requests.get(req_id)
        if tracked is None:
            return None
        if replace:
            tracked.block_ids = list(block_ids or ())
            tracked.group_blocks = [list(ids) for ids in others]
        elif block_ids:
            tracked.block_ids.extend(block_ids)
            for mine, new in zip(tracked.group_blocks, others):
                mine.extend(new)
        if tracked.save_after_first_token:  # a consumer's step after its load: its first token goes out
            tracked.save_after_first_token = False  # before the landed prompt's copy-out (4 GiB at 32k tokens)
            return None
        full = tracked.full_chunks(computed_after, tokens, self.chunk_tokens)
        full = min(full, len(tracked.keys), len(tracked.block_ids) // self.chunk_blocks)
        publish = isinstance(tracked.role, pd.Produce) and not tracked.published \
            and (tracked.prompt_tokens - 1) // self.block_size > 0  # else no consumer would fetch any of it
        if full <= tracked.saved_chunks and not publish:
            return None
        start, tracked.saved_chunks = tracked.saved_chunks, max(full, tracked.saved_chunks)
        blocks = tracked.block_ids[start * self.chunk_blocks : full * self.chunk_blocks]
        keys = tracked.keys[start:full]
        for key in keys:  # re-saved from freshly computed blocks: trust it again
            self._distrusted.discard(key)
        tracked.last_save_step = self._step
        names = () if self.name_chunk is None else tuple(self.name_chunk(req_id, i) for i in range(start, full))
        # A producer publishes the whole prompt, its partial tail too, once all of it is computed;
        # until then a job with what is new (maybe nothing) tells the workers it is still coming.
        final = publish and computed_after >= tracked.prompt_tokens
        self._group_save_jobs += self.groups.saves(
            req_id, tracked.keys, tracked.tail, tracked.prompt_tokens, tracked.group_blocks, start, full,
            computed_before, computed_after, tracked.transfer_id if publish else None, final, states)
        if not publish:
            return SaveJob(req_id, tuple(keys), tuple(blocks), names=names)
        if final and tracked.tail is not None:
            keys = [*keys, tracked.tail]
            blocks = [*blocks, *tracked.block_ids[full * self.chunk_blocks : -(-tracked.prompt_tokens // self.block_size)]]
        tracked.published = final
        return SaveJob(req_id, tuple(keys), tuple(blocks), publish=tracked.transfer_id, final=final, names=names,
                       lease=self.lends_blocks)

    def take_plan(self, saves: list[SaveJob], allocated: tuple[int, ...] = ()) -> StepPlan:
        """This step's jobs; loads count as issued from now. ``allocated``: the step's new blocks (the plan adds its
        loads': their requests are parked, not scheduled, yet their blocks are written now)."""
        # Without kvtier's scheduler nobody reports step completions; vLLM keeps at most one
        # step in flight while it plans the next, so every step before that one has run.
        self._complete_through(self._step - 1)
        now = self.clock()
        for load in self._loads:
            load.issued_s = now
        loads, self._loads = tuple(job for load in self._loads for job in (load.job, *load.others)), []
        # other groups' first: a P/D producer's last anchor job says the transfer is all announced
        saves, self._group_save_jobs = [*self._group_save_jobs, *saves], []
        cancels, withdrawn, stopped, promotes = map(tuple, (self._cancels, self._withdrawn, self._stopped, self._promotes))
        self._cancels, self._withdrawn, self._stopped, self._promotes = [], [], [], []
        reset = self.reset_pending and self._reset_step is None
        if reset:
            self._reset_step = self._step
        self._step += 1
        loaded = tuple(b for job in loads for b in job.block_ids)
        return StepPlan(loads, tuple(saves), cancels, withdrawn, reset, allocated + loaded, stopped, promotes)

    def reset(self) -> None:
        """Empty the tiers (vLLM's ``reset_cache``) with the next step; lookups offer nothing until it ran."""
        self.reset_pending, self._reset_step = True, None
        self._distrusted.clear()

    def step_completed(self) -> None:
        """The oldest step in flight came back from the workers (its saves have been copied out)."""
        self._complete_through(self._completed + 1)

    def _complete_through(self, steps: int) -> None:
        if steps <= self._completed:
            return
        self._completed = min(steps, self._step)
        if self._reset_step is not None and self._completed > self._reset_step:
            self.reset_pending, self._reset_step = False, None
        for req_id, tracked in list(self._requests.items()):
            if tracked.state is ReqState.SAVE_PENDING and tracked.last_save_step < self._completed:
                self._advance(req_id, tracked, Event.SAVES_RUN)

    def loads_reported(self, req_ids: set[str], invalid_block_ids: set[int], failed_req_ids: set[str] = frozenset()) -> None:
        """Workers finished these requests' loads; ``invalid_block_ids`` were not loaded; the loads
        of ``failed_req_ids`` (hybrid models, whose block ids name no group) failed somewhere, and
        the engine drops all their tokens.

        A failed chunk is distrusted: later lookups stop before it, so a request that must
        recompute from the start cannot be offered the same failing load again (vLLM #49176).
        """
        now = self.clock()
        self._load_failures |= failed_req_ids  # a rank may fail before the last rank reports it finished
        for req_id in req_ids:
            failed_request = req_id in self._load_failures
            self._load_failures.discard(req_id)
            tracked = self._requests.get(req_id)
            if tracked is None or tracked.load is None:
                continue
            load, tracked.load = tracked.load, None
            failed = [i for i, b in enumerate(load.job.block_ids) if b in invalid_block_ids]
            if failed_request:
                failed = list(range(len(load.job.block_ids)))  # which chunk is not said: none is kept
            event = Event.LOADED
            self.counts["loads_failed" if failed else "loads_ok"] += 1
            if failed and load.job.remote is not None:
                tracked.remote_failed = True  # a re-admission recomputes, it never asks the producer again
            if failed:
                chunk = (load.job.first_block + failed[0]) // self.chunk_blocks
                # recomputed from the failed chunk on: saved again from there
                tracked.saved_chunks = min(tracked.saved_chunks, load.start // self.chunk_tokens + chunk)
                remote = load.job.remote
                if remote is None or chunk < remote.first_chunk:  # a producer's chunk is not ours to distrust
                    self._distrusted.add(load.job.keys[chunk])
                if (load.start + failed[0] * self.block_size == 0 or failed_request) \
                        and tracked.state is ReqState.WAITING_FOR_KV:
                    # vLLM keeps the valid prefix; with none it frees the blocks and admits the
                    # request again from a fresh lookup, which plans no load: vLLM keeps such a
                    # request among its in-flight prefills, and another asynchronous load would
                    # reserve its own blocks against itself (in a full pool it would never start).
                    event, tracked.load_failed = Event.RETRY, True
            elif load.issued_s is not None and len(set(load.tiers)) == 1:
                self.meter.record_load(load.tiers[0], len(load.job.keys) * self.chunk_tokens, now - load.issued_s)
            tracked.save_after_first_token = not failed and load.job.remote is not None and not self.groups.others
            self._advance(req_id, tracked, event)

    def preempted(self, req_id: str) -> None:
        tracked = self._requests.get(req_id)
        if tracked is not None and isinstance(tracked.role, pd.Produce):  # its blocks go back to vLLM now
            self._stopped.append(tracked.transfer_id)
        if tracked is not None and tracked.state in (ReqState.RUNNING, ReqState.PREFILL_TO_BOUNDARY):
            tracked.handoff = tracked.plan = None
            self._advance(req_id, tracked, Event.PREEMPTED)

    def finished(self, req_id: str, completed: bool = True, lent: list[int] | None = None) -> dict | None:
        """The request stopped (``completed``: on length, EOS or a stop string) or was aborted. Returns the
        ``kv_transfer_params`` of a completed P/D producer request, for the consumer (``lent``: its blocks, if lent)."""
        if (tracked := self._requests.get(req_id)) is None:
            return None
        params = None
        if isinstance(tracked.role, pd.Produce) and not completed:
            self._stopped.append(tracked.transfer_id)
            if not tracked.published:
                self._withdrawn += self.groups.transfers(tracked.transfer_id)  # a consumer waiting stops
        if isinstance(tracked.role, pd.Produce) and completed:
            if self.endpoints():
                params = pd.published(tracked.transfer_id, self.engine_id, self.peer_endpoints, self.tp_size, lent,
                                      self.config.pd_hbm_lease_ms)
            else:
                logger.warning("kvtier P/D: request %s finished before this engine's chunk servers were known; "
                               "the decode engine will recompute it.", req_id)
        if tracked.load is not None and tracked.load.job.remote is not None:
            self._cancels.append(req_id)  # vLLM keeps its blocks until the cancelled load reports
        self._advance(req_id, tracked, Event.FINISHED, saves_pending=tracked.last_save_step >= self._completed)
        return params

    @property
    def lends_blocks(self) -> bool:
        """Whether finished producer requests' blocks stay for decoders to READ (hybrids: the CPU-tier path)."""
        return self.config.pd_hbm_lease_ms > 0 and not self.groups.others

    def published(self, req_id: str) -> tuple[str, tuple[bytes, ...]] | None:
        """A P/D producer request's transfer id and its published chunks' chain keys (the tail's last), if a consumer will know; else None."""
        tracked = self._requests.get(req_id)
        if tracked is None or not isinstance(tracked.role, pd.Produce) or not self.endpoints():
            return None
        return tracked.transfer_id, tuple(tracked.keys + ([tracked.tail] if tracked.tail is not None else []))

    def promote(self, keys: list[bytes]) -> None:
        """Read these disk chunks of a prompt still waiting into the CPU tier from the next step on (lowest priority:
        :mod:`kvtier.transfer.promote`), before the step's earlier ones: a prompt looked at later waits longer."""
        self._promotes[:0] = keys

    def endpoints(self) -> list[str]:
        """This engine's P/D chunk servers, asked again while unknown (a rank may announce its own late)."""
        if not self.peer_endpoints and (reply := self.client.lookup([], always=True)) is not None:
            self.peer_endpoints = reply.endpoints
        return self.peer_endpoints

    def state(self, req_id: str) -> ReqState | None:
        return tracked.state if (tracked := self._requests.get(req_id)) else None

    def lookups(self, req_id: str) -> int:
        return tracked.lookups if (tracked := self._requests.get(req_id)) else 0

    def close(self) -> None:
        self.client.close()

    # ---- internals ----------------------------------------------------------------------------
    def _advance(self, req_id: str, tracked: Tracked, event: Event, saves_pending: bool = False) -> None:
        tracked.state = advance(tracked.state, event, saves_pending)
        if tracked.state is ReqState.DONE:
            del self._requests[req_id]

    def _plan_job(self, req_id: str, tracked: Tracked, start: int, end: int, block_ids: list[int]) -> None:
        """Load tokens ``[start, end)``: whole blocks (a P/D consumer's to the prompt's last partial one)."""
        c, b = self.chunk_tokens, self.block_size
        first, last = start // c, -(-end // c)
        all_keys = tracked.keys + ([tracked.tail] if tracked.tail is not None else [])
        keys, blocks = tuple(all_keys[first:last]), tuple(block_ids[start // b : -(-end // b)])
        tail_blocks = tracked.tail_blocks(self.chunk_tokens, self.block_size) if last > len(tracked.keys) else 0
        remote = None
        if isinstance(tracked.role, pd.Consume) and "remote" in tracked.tiers[first:last]:
            role, at = tracked.role, tracked.tiers[first:last].index("remote")  # P's blocks: from the first fetched on
            remote = RemoteSource(role.transfer_id, role.endpoints, at, role.wait, role.remote_blocks[(first + at) * self.chunk_blocks:])
        job = LoadJob(req_id, keys, (start % c) // b, blocks, tail_blocks, remote)
        from_chunk = first + remote.first_chunk if remote is not None else 0
        others = self.groups.loads(req_id, tracked.keys, tracked.tail, tracked.group_blocks, start, end,
                                   tracked.tail_blocks(self.chunk_tokens, self.block_size), remote, from_chunk)
        tracked.load = PlannedLoad(job, tracked.tiers[first:last], start, others=others)
        self._loads.append(tracked.load)
