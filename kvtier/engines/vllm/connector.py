"""``KvtierConnector``: vLLM's ``KVConnectorBase_V1`` over kvtier's scheduler and worker halves.

Scheduler half (:mod:`.scheduler_side`): asks the lookup server how much of a prompt is stored beyond the engine's
own prefix cache, parks the request in ``WAITING_FOR_REMOTE_KVS`` while the workers load it, plans saves of every
new full chunk, and times every step for the cost model. Worker half (:mod:`.worker_side`): builds the layouts from
the registered KV tensors and starts a :mod:`kvtier.worker_node` over them, which runs the loads, saves and lookups.

P/D speaks vLLM's standard ``kv_transfer_params`` (:mod:`kvtier.pd.params`): a request with ``do_remote_decode``
publishes its prompt and returns the parameters a decode engine needs from ``request_finished``; a request with
``do_remote_prefill`` loads the prompt from the producer through the same plan, waiting state and load executor as a
reload.

Hybrid models (vLLM's hybrid KV cache manager): the connector is ``SupportsHMA`` where vLLM has it, so the manager
stays on. kvtier serves a config whose transferred KV cache groups it can all serve (:mod:`.groups`: full attention,
sliding window, chunked local attention, Mamba state cached by block), each group's blocks under keys of its own, a
windowed group only within its window, Mamba state at chunk ends; any other config runs with kvtier idle: no hits
(the engine recomputes), no saves, one start-up line naming the groups it does not serve. vLLM takes no block-level
load failures from a model of several groups, so there the workers report a failed load per request and the engine
recomputes its whole prompt: through ``get_transfer_results`` (``failed_recving``) where vLLM has it, else
:func:`~kvtier.engines.vllm.compat.recompute_failed_loads`.

Hook order: blocks given out in a step wait for saves still reading them before the step's kernels are launched
(``bind_connector_metadata``, which every release calls before the forward; vLLM >= 0.32 calls ``start_load_kv``
after the forward's launch when no load of the step is synchronous: kvtier's never are, their requests wait).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from kvtier.config import KvtierConfig
from kvtier.engines.vllm.compat import (
    HMA_BASES, AgreedHits, CacheHitSource, KVConnectorTransferResults, agree_on_hybrid_hits, boundary_states,
    check_version, recompute_failed_loads,
)
from kvtier.engines.vllm.groups import MAMBA_KINDS, GroupSupport, context_refused, group_support, kv_heads
from kvtier.profiled import name_hooks
from kvtier.engines.vllm.scheduler_side import SchedulerSide
from kvtier.jobs import Lend, StepPlan
from kvtier.pd.params import fetched_transfer
from kvtier.timeline import mark
from kvtier.engines.vllm.events import KvtierKVEvents, name_chunk
from kvtier.engines.vllm.stats import FAILED_REQUESTS, KvtierPromMetrics, build_stats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_SOURCES = {} if CacheHitSource is None else {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK,
                                               "remote": CacheHitSource.P2P, "shared": CacheHitSource.EXTERNAL_UNSPECIFIED}
_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)  # not aborted, not failed

_WORKER_MODULE = "kvtier.engines.vllm.worker_side"
logger = logging.getLogger(__name__)


def _import_quietly(name: str) -> None:
    """Import ``name`` now; an error shows when the module is imported again in the foreground."""
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001
        pass


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    plan: StepPlan
    lends: tuple[Lend, ...] = ()  # finished producer requests whose blocks the workers keep for decode engines
    idle: bool = False  # the step computes nothing (requests only wait, e.g. for their loads)


class KvtierConnector(KVConnectorBase_V1, *HMA_BASES):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        check_version()
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config = KvtierConfig.from_dict(transfer.kv_connector_extra_config)
        self.groups: GroupSupport = group_support(kv_cache_config)
        refused = context_refused(vllm_config)
        self.active = self.groups.active and not refused  # False: kvtier stays idle (no hits, no saves) here
        served = self.groups.served if self.active else ()
        self.group = served[0].index if served else 0  # the anchor KV cache group (lookups run on its chunks)
        self.other_groups = tuple(g.index for g in served[1:])  # served beside it (hybrid models)
        self.block_size = self.groups.block_size or vllm_config.cache_config.block_size
        if self.active and self.groups.state_groups and self.config.chunk_tokens % self.block_size:
            # vLLM sizes a Mamba hybrid's blocks to hold a state page: no chunk size can be known
            # before it starts, and one block per chunk keeps a state at every step's end.
            if role == KVConnectorRole.SCHEDULER:
                logger.info("kvtier: chunks of %d tokens, one block of this Mamba hybrid (setting 'chunk_tokens', "
                            "%d, is not a multiple of it).", self.block_size, self.config.chunk_tokens)
            self.config = dataclasses.replace(self.config, chunk_tokens=self.block_size)
        if self.active:
            self.config.check_block_size(self.block_size)
        if self.active and self.other_groups and role == KVConnectorRole.SCHEDULER:
            logger.info("kvtier serves %d KV cache groups (%s), block size %d.", len(served), self.groups.describe(),
                        self.block_size)
        elif not self.active and role == KVConnectorRole.SCHEDULER:  # one line per engine, not one per worker
            hint = (" To have kvtier serve it, with full KV in every layer, start vLLM with "
                    "--disable-hybrid-kv-cache-manager." if self.groups.fits_without_hybrid and not refused else "")
            logger.warning("kvtier is idle in this engine: %s; every prompt is computed by the engine and nothing is "
                           "saved.%s", refused or f"it does not serve these KV cache groups ({self.groups.describe()})",
                           hint)
        model = vllm_config.model_config.model
        endpoint = self.config.lookup_endpoint(transfer.engine_id)
        self._scheduler: SchedulerSide | None = None
        self._worker = None
        # Mamba hybrids: the scheduler must take the hit every group holds (see agree_on_hybrid_hits);
        # done at the first lookup, when vLLM's scheduler is on the stack and its cache still empty.
        self._agree_on_hits = role == KVConnectorRole.SCHEDULER and not MAMBA_KINDS.isdisjoint(self.groups.kinds)
        self._agreed_hits: AgreedHits | None = None
        parallel, events_config = vllm_config.parallel_config, vllm_config.kv_events_config
        kv_events = events_config is not None and events_config.enable_kv_cache_events
        self._live: dict[str, Request] = {}  # live requests: their reply's tokens, their saved chunks' names
        self._lends: list[Lend] = []  # producer requests whose blocks to keep, for the next step's workers
        self._lent: set[str] = set()  # ... kept now: vLLM frees them once the workers say so (finished_sending)
        self._events = KvtierKVEvents(num_workers=0)  # from the workers, until vLLM takes them
        if role == KVConnectorRole.SCHEDULER and self.active:  # idle: no scheduler half either (its chunk
            # geometry may not fit a block size vLLM chose for another group, e.g. a Mamba state page)
            self._scheduler = SchedulerSide(self.config, model, self.block_size, endpoint, engine_id=transfer.engine_id,
                                            tp_size=parallel.world_size,
                                            name_chunk=self._name_chunk if kv_events else None, groups=served)
        elif self.active:
            # The worker half's module loads LMCache (seconds): it is imported in the background
            # while vLLM loads the model and profiles, and waited for at register_kv_caches.
            self._worker_args = (self.config, model, self.block_size, kv_cache_config.num_blocks, endpoint,
                                 parallel.rank, parallel.world_size)
            self._worker_kwargs = dict(produce=transfer.kv_role != "kv_consumer", kv_events=kv_events,
                                       groups=tuple((g.kind, g.window, g.layers) for g in served), heads=kv_heads(vllm_config),
                                       load_inline=parallel.distributed_executor_backend == "uni")  # shares the loop's GIL
            self._importing = threading.Thread(target=_import_quietly, args=(_WORKER_MODULE,), daemon=True,
                                               name="kvtier-import")
            self._importing.start()

    # ---- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.active:
            return
        self._importing.join()
        WorkerSide = importlib.import_module(_WORKER_MODULE).WorkerSide  # raises here if the import failed
        if 0 < (interval := self.config.switch_interval_s) < sys.getswitchinterval():
            sys.setswitchinterval(interval)  # kvtier's threads get the interpreter soon after each wait (config.py)
        self._worker = WorkerSide(*self._worker_args, **self._worker_kwargs)
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvtierMetadata):
            self._worker.guard_reuse(connector_metadata.plan)  # before this step's kernels are launched

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        if self._worker is None:
            return
        if meta.plan.reset:
            self._worker.reset()
        self._worker.lend(meta.lends)
        self._worker.start_loads(meta.plan.loads, meta.plan.cancels, busy=not meta.idle, promotes=meta.plan.promotes)
        self._worker.announce(meta.plan.saves, meta.plan.withdrawn)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous: the request waits, not the layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves copy whole chunks after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        # vLLM >= 0.32 calls this on every step, empty ones included: nothing to do without saves
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        if meta.plan.saves:
            self._worker.save(meta.plan.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, KvtierMetadata) and meta.idle:  # not spin through idle steps while transfers run
            self._worker.wait_idle(self.config.idle_wait_s)
        return self._worker.finished_sends(finished_req_ids) or None, self._worker.finished_loads() or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM >= 0.32 (``KVConnectorTransferResults``): :meth:`get_finished`, and the loads that
        failed as a whole (a hybrid model's), which the engine recomputes itself."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_loads() if self._worker is not None else set()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()) | failed, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.failed_blocks() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self._worker.take_stats() if self._worker is not None else None
        return None if data is None else build_stats(data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return build_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_kv_cache_events(self) -> KvtierKVEvents | None:
        if self._worker is None:
            return None
        events, settling = self._worker.take_events()
        return KvtierKVEvents(events, settling=settling) if events or settling else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ---- scheduler side -----------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        if not self.active:
            return
        mark(request.request_id, "arrived", fetched_transfer(request.kv_transfer_params))
        self._scheduler.track(request.request_id, request.prompt_token_ids or [], request.cache_salt,
                              request.kv_transfer_params)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._agree_on_hits:
            self._agree_on_hits = False
            self._agreed_hits = agree_on_hybrid_hits()
            if self._agreed_hits is not None:
                logger.info("kvtier: this vLLM admits a Mamba-hybrid request at its full-attention hit, where "
                            "the Mamba state may not be cached; kvtier, which restores only the states it "
                            "stored, has it take the hit every KV cache group holds.")
        elif self._agreed_hits is not None:
            self._agreed_hits.restore_junction(request)
        if not self.active:
            return 0, False  # a hit must hold for every group; some group kvtier cannot fill
        if self._scheduler.state(request.request_id) is None:  # vLLM < 0.32 has no on_new_request
            mark(request.request_id, "arrived", fetched_transfer(request.kv_transfer_params))
        plan = self._scheduler.matched_tokens(request.request_id, request.prompt_token_ids or [], request.cache_salt,
                                              num_computed_tokens, request.kv_transfer_params)
        if self._scheduler.lookups(request.request_id) == 1:  # the timeline marks the first lookup
            mark(request.request_id, "looked up")
        n = plan.external_tokens  # 0 for a handoff: admitted as a prefill, parked at its boundary
        return n, n > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.active:
            self._live[request.request_id] = request  # every release calls this before the request's first step
            if num_external_tokens:
                mark(request.request_id, "planned")
            ids = blocks.get_block_ids()
            self._scheduler.allocated(request.request_id, ids[self.group], num_external_tokens,
                                      tuple(ids[g] for g in self.other_groups))

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The groups a load fills (vLLM >= 0.32 asks, to skip zeroing their new blocks)."""
        return (self.group, *self.other_groups) if self.active else ()

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict:
        """Tokens per tier (vLLM >= 0.32 asks; older releases never call it)."""
        counts = self._scheduler.hit_sources(request.request_id) if self.active else {}
        if sum(counts.values()) != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return {_SOURCES[tier]: n for tier, n in counts.items()}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if not self.active:
            return KvtierMetadata(StepPlan((), ()))
        scheduler, saves, allocated, g, others = self._scheduler, [], [], self.group, self.other_groups
        tokens = lambda req_id: getattr(self._live.get(req_id), "all_token_ids", None)  # noqa: E731 prompt, output
        states = boundary_states(scheduler_output)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():  # also vLLM's own scheduler's
            scheduler.preempted(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            before = new.num_computed_tokens
            computed = before + scheduler_output.num_scheduled_tokens[new.req_id]
            saves.append(scheduler.scheduled(new.req_id, new.block_ids[g], True, computed,
                                             tuple(new.block_ids[o] for o in others), before,
                                             states.get(new.req_id, ()), tokens(new.req_id)))
            allocated += [b for ids in new.block_ids for b in ids]  # every group's: blocks are one pool
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if new_blocks:
                allocated += [b for ids in new_blocks for b in ids]
            before = cached.num_computed_tokens[i]
            computed = before + scheduler_output.num_scheduled_tokens[req_id]
            saves.append(
                scheduler.scheduled(
                    req_id, new_blocks[g] if new_blocks else None, req_id in cached.resumed_req_ids, computed,
                    tuple(new_blocks[o] for o in others) if new_blocks else (), before, states.get(req_id, ()),
                    tokens(req_id))
            )
        lends, self._lends = tuple(self._lends), []
        scheduler.steps.planned(scheduler_output.total_num_scheduled_tokens)
        return KvtierMetadata(scheduler.take_plan([s for s in saves if s is not None], tuple(allocated)), lends,
                              scheduler_output.total_num_scheduled_tokens == 0)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if not self.active:
            return
        self._scheduler.steps.ended()
        events = connector_output.kv_cache_events
        if events:
            self._events.add_events(events.get_all_events())
        self._events.settling = bool(events and getattr(events, "settling", False))
        stats = connector_output.kv_connector_stats
        failed = set(stats.data.pop(FAILED_REQUESTS, ()) if stats is not None else ())
        if failed:  # a hybrid model's, on a vLLM without failed_recving: the engine drops each one's tokens
            recompute_failed_loads(failed)  # and looks it up afresh
        failed |= set(getattr(connector_output, "failed_recving", None) or ())  # vLLM did that itself
        loaded = set(connector_output.finished_recving or ())
        for req_id in loaded:
            mark(req_id, "load seen")
        self._scheduler.loads_reported(loaded, set(connector_output.invalid_block_ids or ()), failed)
        if connector_output.finished_sending:
            self._lent.difference_update(connector_output.finished_sending)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Blocks may be freed now: saves are copied out inside the step that planned them, and
        # vLLM itself holds a waiting request's blocks until its load reports. A completed P/D
        # producer request's blocks stay for decode engines to read HBM to HBM, under a lease
        # that its workers end (finished_sending).
        self._live.pop(request.request_id, None)
        if not self.active:
            return False, None
        completed = request.status in _COMPLETED
        lent = completed and self._lend(request.request_id, block_ids)
        params = self._scheduler.finished(request.request_id, completed, block_ids if lent else None)
        mark(request.request_id, "finished", params["remote_request_id"] if params else None)
        return lent, params

    def _lend(self, req_id: str, block_ids: list[int]) -> bool:
        """Keep a completed producer request's blocks for decode engines to READ (``pd_hbm_lease_ms``).
        Only where this engine publishes: a consumer runs no chunk server, so nothing is published."""
        published = self._scheduler.published(req_id) if self._scheduler.lends_blocks and block_ids else None
        if published is None:
            return False
        self._lends.append(Lend(req_id, published[0], tuple(block_ids), published[1], self.config.pd_hbm_lease_ms))
        self._lent.add(req_id)
        return True

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` under the hybrid KV cache manager: ``block_ids`` holds each
        KV cache group's blocks (vLLM calls this instead where the connector is ``SupportsHMA``)."""
        return self.request_finished(request, block_ids[self.group] if self.active else [])

    def take_events(self) -> Iterable[KVCacheEvent]:
        events = self._events.get_all_events()
        self._events.clear_events()
        return events

    def reset_cache(self) -> bool:
        """Empty this engine's CPU and disk tiers (at the next step, which this asks vLLM to run)."""
        if self.active:  # an idle kvtier stores nothing here
            self._scheduler.reset()
        return True

    def has_pending_push_work(self) -> bool:
        # Keeps an idle engine stepping until the tiers are emptied / every stored chunk is announced /
        # every lease of a producer's blocks has ended.
        return (self.active and self._scheduler.reset_pending) or bool(self._lent) or self._events.settling

    def _name_chunk(self, req_id: str, chunk: int):
        request = self._live.get(req_id)
        return None if request is None else name_chunk(request, chunk, self._scheduler.chunk_blocks, self.block_size)

    @property
    def scheduler_side(self) -> SchedulerSide | None:
        """The scheduler half (None in worker processes and where kvtier is idle); kvtier's scheduler
        drives its handoffs."""
        return self._scheduler


name_hooks(KvtierConnector, ("bind_connector_metadata", "start_load_kv", "wait_for_save", "get_finished",
                             "get_num_new_matched_tokens", "build_connector_meta", "update_connector_output",
                             "request_finished"))
