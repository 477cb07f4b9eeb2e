"""One per-request state machine for every KV source (a tier reload, a handoff, a remote prefill).

::

    LOOKUP ──recompute──────────────────────────────► RUNNING ──finish──► DONE
      │  ──load / remote──► WAITING_FOR_KV ──loaded──►   │ ▲               ▲
      │  ──handoff──► PREFILL_TO_BOUNDARY ──park──┘      │ │               │
      │                   │ └──park failed──────────────►┘ │        SAVE_PENDING
      ◄──────preempt──────┴──────────────────────────────┘     (saves of the step not yet run)
    WAITING_FOR_KV ──finish (abort)──► FINISHED_LOAD_PENDING ──loaded──► DONE
    WAITING_FOR_KV ──retry (nothing usable loaded, vLLM re-admits from scratch)──► LOOKUP

``WAITING_FOR_KV`` is vLLM's ``WAITING_FOR_REMOTE_KVS``: the request holds its blocks and runs
nothing. It resumes as a suffix prefill (a reload; a failed range is recomputed) or as decode
(a remote prefill that delivered the whole prompt). A request aborted while waiting keeps its
blocks until the load reports (``FINISHED_LOAD_PENDING``): the workers may still be writing them.
Preemption can only hit requests that run (vLLM never preempts a waiting one).
"""

from __future__ import annotations

import enum


class ReqState(enum.Enum):
    LOOKUP = "lookup"
    PREFILL_TO_BOUNDARY = "prefill_to_boundary"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    SAVE_PENDING = "save_pending"
    FINISHED_LOAD_PENDING = "finished_load_pending"
    DONE = "done"


class Event(enum.Enum):
    RECOMPUTE = "recompute"  # admitted with nothing to load
    LOAD = "load"  # admitted with a load (tier or remote): parked
    HANDOFF = "handoff"  # admitted as a prefill that stops at the chunk boundary
    PARK = "park"  # the handoff prefill reached the boundary: parked for the load of the rest
    PARK_FAILED = "park_failed"  # no blocks for the rest: recompute it instead
    LOADED = "loaded"  # the workers reported the load (succeeded, or failed past its first token)
    RETRY = "retry"  # the load failed at the prompt's first token: the engine looks it up afresh
    PREEMPTED = "preempted"
    FINISHED = "finished"  # stopped or aborted
    SAVES_RUN = "saves_run"  # the step that carried the request's last saves completed


S, E = ReqState, Event
TRANSITIONS: dict[tuple[ReqState, Event], ReqState] = {
    (S.LOOKUP, E.RECOMPUTE): S.RUNNING,
    (S.LOOKUP, E.LOAD): S.WAITING_FOR_KV,
    (S.LOOKUP, E.HANDOFF): S.PREFILL_TO_BOUNDARY,
    (S.LOOKUP, E.FINISHED): S.DONE,
    (S.PREFILL_TO_BOUNDARY, E.PARK): S.WAITING_FOR_KV,
    (S.PREFILL_TO_BOUNDARY, E.PARK_FAILED): S.RUNNING,
    (S.PREFILL_TO_BOUNDARY, E.PREEMPTED): S.LOOKUP,
    (S.PREFILL_TO_BOUNDARY, E.FINISHED): S.DONE,
    (S.WAITING_FOR_KV, E.LOADED): S.RUNNING,
    (S.WAITING_FOR_KV, E.RETRY): S.LOOKUP,
    (S.WAITING_FOR_KV, E.FINISHED): S.FINISHED_LOAD_PENDING,
    (S.FINISHED_LOAD_PENDING, E.LOADED): S.DONE,
    (S.RUNNING, E.PREEMPTED): S.LOOKUP,
    (S.RUNNING, E.FINISHED): S.DONE,
    (S.SAVE_PENDING, E.SAVES_RUN): S.DONE,
}
TERMINAL = frozenset({S.DONE})


class IllegalTransition(RuntimeError):
    """An event arrived in a state that cannot take it: a bug in the caller, never a user error."""


def advance(state: ReqState, event: Event, saves_pending: bool = False) -> ReqState:
    """The state after ``event``. ``saves_pending`` (for ``FINISHED``): the request has saves
    planned in a step that has not run yet, so it is not done until they run."""
    try:
        nxt = TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"event {event.value!r} in state {state.value!r}") from None
    if nxt is S.DONE and event is E.FINISHED and saves_pending:
        return S.SAVE_PENDING
    return nxt
