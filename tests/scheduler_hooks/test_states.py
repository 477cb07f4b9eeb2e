"""The per-request state machine: every lifecycle the vLLM adapter drives, and what it refuses."""

from __future__ import annotations

import pytest

from kvtier.scheduler_hooks import Event as E, IllegalTransition, ReqState as S, advance


def run(*events, saves_pending=False):
    state = S.LOOKUP
    for event in events:
        state = advance(state, event, saves_pending)
    return state


@pytest.mark.parametrize("events", [
    (E.RECOMPUTE, E.FINISHED),  # no hit
    (E.LOAD, E.LOADED, E.FINISHED),  # reload, resumed as suffix prefill (or decode, for remote)
    (E.HANDOFF, E.PARK, E.LOADED, E.FINISHED),  # prefill to the boundary, load the rest
    (E.HANDOFF, E.PARK_FAILED, E.FINISHED),  # no blocks for the rest: prefill it
    (E.LOAD, E.FINISHED, E.LOADED),  # aborted while waiting: done once the load reports
    (E.LOAD, E.RETRY, E.LOAD, E.LOADED, E.FINISHED),  # nothing usable loaded: a fresh lookup
    (E.RECOMPUTE, E.PREEMPTED, E.LOAD, E.LOADED, E.FINISHED),
    (E.HANDOFF, E.PREEMPTED, E.RECOMPUTE, E.FINISHED),
    (E.FINISHED,),  # aborted in the queue
])
def test_lifecycles_end_done(events):
    assert run(*events) is S.DONE


def test_waiting_keeps_blocks_until_the_load_reports():
    assert run(E.LOAD, E.FINISHED) is S.FINISHED_LOAD_PENDING


def test_finish_with_saves_pending_waits_for_the_step():
    state = run(E.RECOMPUTE, E.FINISHED, saves_pending=True)
    assert state is S.SAVE_PENDING
    assert advance(state, E.SAVES_RUN) is S.DONE


@pytest.mark.parametrize("events", [
    (E.LOAD, E.PREEMPTED),  # vLLM never preempts a waiting request
    (E.LOAD, E.LOAD),  # one load at a time
    (E.RECOMPUTE, E.LOADED),  # a report for a load never planned
    (E.RECOMPUTE, E.FINISHED, E.FINISHED),  # finished twice
    (E.LOAD, E.FINISHED, E.FINISHED),
])
def test_illegal_transitions_raise(events):
    with pytest.raises(IllegalTransition):
        run(*events)
