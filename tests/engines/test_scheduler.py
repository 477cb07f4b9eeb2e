"""Targeted scenarios of kvtier's scheduler half inside the real vLLM scheduler (see sched_harness).

Each pins one path the state machine test reaches only by chance, and regressions are named
after the bug they pin.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvtier.scheduler_hooks import ReqState  # noqa: E402
from sched_harness import VOCAB, Harness  # noqa: E402

BS, CHUNK = 16, 64


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


P = prompt(1, 5 * CHUNK + 20)  # five full chunks and a tail


@pytest.fixture
def make():
    made = []

    def build(**kw) -> Harness:
        h = Harness(block_size=BS, chunk_tokens=CHUNK, num_blocks=64, **kw)
        made.append(h)
        return h

    yield build
    for h in made:
        h.close()


def stored_with_floor(h: Harness, floor_blocks: int) -> None:
    """P's chunks are stored; the engine's prefix cache holds exactly ``floor_blocks`` of its blocks."""
    h.add(P, 1)
    h.drain()
    assert len(h.index.chunks) == 5
    h.sched.reset_prefix_cache()
    if floor_blocks:
        h.add(P[: floor_blocks * BS], 1)
        h.drain()
    h.stats = type(h.stats)()


def test_aligned_floor_loads_whole_chunks(make):
    h = make(unaligned="handoff")
    stored_with_floor(h, 4)  # 64 tokens: a chunk boundary
    h.add(P, 2)
    h.drain()
    assert dict(h.stats.loads) == {"load": 1} and h.stats.resumed_checked == 1
    h.check_quiescent()


def test_steps_while_a_request_only_waits_for_its_load_tell_the_workers_they_compute_nothing(make):
    h = make()
    stored_with_floor(h, 0)
    h.add(P, 2)
    for _ in range(4):
        h.step(lags=[3])  # the load takes three steps, and nothing else runs meanwhile
    assert h.stats.idle_steps >= 2 and h.stats.loads == {"load": 1}
    h.drain()
    h.check_quiescent()


def test_partial_loads_block_by_block_from_the_floor(make):
    h = make(unaligned="partial")
    stored_with_floor(h, 5)  # 80 tokens: one block into chunk 1
    req = h.add(P, 2)
    h.step(lags=[1])
    assert h.requests[req].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (job,) = [p.job for p in h.pending]
    assert job.first_block == 1 and len(job.block_ids) == 4 * 4 - 1  # chunks 1-4 minus the floor's block
    h.drain()
    assert dict(h.stats.loads) == {"partial": 1} and h.stats.resumed_checked == 1
    h.check_quiescent()


def test_handoff_prefills_to_the_boundary_then_loads_the_rest(make):
    h = make(unaligned="handoff")
    stored_with_floor(h, 5)
    req = h.add(P, 2)
    out = h.sched.schedule()
    assert out.num_scheduled_tokens[req] == 2 * CHUNK - 5 * BS  # capped at the next chunk boundary
    h.sched.update_from_output(out, h._runner_output(out, set(), set()))  # (no KV check: a bare step)
    h._forward(out)
    assert h.side.state(req) is ReqState.PREFILL_TO_BOUNDARY
    h.step(lags=[1])  # parked: blocks through the hit, an aligned load of chunks 2-4
    assert h.requests[req].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (job,) = [p.job for p in h.pending]
    assert job.first_block == 0 and len(job.keys) == 3 and len(job.block_ids) == 3 * 4
    resumed = []
    for _ in range(3):
        h.step()
        resumed += h.sched.prev_step_scheduled_req_ids & {req}
    assert resumed, "the handoff never resumed"
    h.drain()
    assert dict(h.stats.loads) == {"handoff": 1} and h.stats.resumed_checked == 1
    h.check_quiescent()


def test_handoff_resumes_as_a_resumed_request_with_its_full_block_table(make):
    h = make(unaligned="handoff")
    stored_with_floor(h, 5)
    req = h.add(P, 2)
    h.step(lags=[0])  # prefill to the boundary
    h.step(lags=[0])  # parked; the load runs and reports in the same step
    out = h.sched.schedule()
    cached = out.scheduled_cached_reqs
    assert req in cached.resumed_req_ids
    i = cached.req_ids.index(req)
    assert cached.new_block_ids[i][0] == h._blocks(req)  # replaced whole, never appended
    assert cached.num_computed_tokens[i] == 5 * CHUNK
    h.sched.update_from_output(out, h._runner_output(out, set(), set()))


def test_finished_waiters_are_scheduled_before_fresh_admissions(make):
    h = make(unaligned="partial", max_batched=16)
    stored_with_floor(h, 0)
    waiter = h.add(P, 2)
    h.step(lags=[1])  # parked
    h.step()  # the load runs and reports
    h.add(prompt(9, 200), 2)  # a fresh request, queued before the waiter is promoted
    out = h.sched.schedule()
    assert out.num_scheduled_tokens == {waiter: 16}  # the whole budget went to the waiter
    h.sched.update_from_output(out, h._runner_output(out, set(), set()))


def test_abort_while_waiting_frees_blocks_once_after_the_load_reports(make):
    h = make(unaligned="partial")
    stored_with_floor(h, 0)
    free_before = h.pool.get_num_free_blocks()
    req = h.add(P, 2)
    h.step(lags=[3])
    held = free_before - h.pool.get_num_free_blocks()
    assert held == 5 * CHUNK // BS  # the tail's blocks come after the load
    h.abort(req)
    assert h.side.state(req) is ReqState.FINISHED_LOAD_PENDING
    for _ in range(3):
        assert free_before - h.pool.get_num_free_blocks() == held, "freed while the workers still write"
        h.step()
    assert h.pool.get_num_free_blocks() == free_before
    assert h.side.state(req) is None
    h.drain()
    h.check_quiescent()


def test_preemption_during_a_handoff_prefill_replans(make):
    h = make(unaligned="handoff")
    stored_with_floor(h, 5)
    req = h.add(P, 2)
    out = h.sched.schedule()
    assert h.side.state(req) is ReqState.PREFILL_TO_BOUNDARY
    h.sched.update_from_output(out, h._runner_output(out, set(), set()))
    h._forward(out)
    h.sched.reset_prefix_cache(reset_running_requests=True)  # preempts every running request
    assert h.side.state(req) is ReqState.LOOKUP
    h.drain()
    h.check_quiescent()


def test_failed_load_with_nothing_usable_is_planned_again_regression(make):
    """Found by the state machine: a load that failed at the prompt's first block left kvtier in
    RUNNING while vLLM re-admitted the request from a fresh lookup; the new load was never
    planned and the request waited forever."""
    h = make(unaligned="partial")
    stored_with_floor(h, 0)
    h.fail_next.add(h.keys[h.add(P, 1)][0])  # its own admission: the first chunk fails
    h.drain()
    h.check_quiescent()
    assert h.stats.failed_loads == 1


def test_stale_index_does_not_livelock_vllm_49176(make):
    """A chunk the index keeps offering but that never loads: after one failure the scheduler
    distrusts it, so the request recomputes instead of retrying the same load forever."""
    h = make(unaligned="partial")
    stored_with_floor(h, 0)
    h.stale = True  # the failing chunk stays in the index
    req = h.add(P, 1)
    for key in h.keys[req]:
        h.fail_next.add(key)
    h.step(lags=[0])
    h.fail_next.clear()
    for key in h.keys[req]:
        h.fail_next.add(key)  # would fail again, were it offered again
    h.drain(max_steps=20)
    assert h.stats.failed_loads == 1
    h.check_quiescent()


def test_without_kvtier_scheduler_handoff_falls_back_to_partial(make):
    h = make(unaligned="handoff", scheduler_cls=Scheduler)
    stored_with_floor(h, 5)
    h.add(P, 2)
    h.drain()
    assert dict(h.stats.loads) == {"partial": 1}
    h.check_quiescent()


@pytest.mark.parametrize("scheduler_cls", [Scheduler, None], ids=["vLLM's scheduler", "kvtier's"])
def test_every_step_is_timed_for_the_cost_model_whatever_the_scheduler(make, scheduler_cls):
    """The recompute side of a veto comes from the engine's step times: the connector takes them
    itself, so a slow tier is vetoed with vLLM's own scheduler too (no step time: no veto ever)."""
    h = make(**({"scheduler_cls": scheduler_cls} if scheduler_cls else {}))
    meter = h.sched.connector.scheduler_side.meter
    assert meter.model().step is None
    h.add(P, 3)  # one prefill step of 340 tokens, then decode steps
    h.drain()
    line = meter.model().step
    assert line is not None and meter.steps.large_samples >= 1 and meter.steps.small_samples >= 1
