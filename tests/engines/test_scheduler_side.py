"""The scheduler half on its own: plan commits, cost-veto probes, distrust of failed chunks.

The lookup client is replaced by a stub that answers from a list of tiers.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier.config import KvtierConfig  # noqa: E402
from kvtier.engines.vllm.scheduler_side import PROBE_EVERY, SchedulerSide  # noqa: E402
from kvtier.lookup.protocol import VERSION, LookupReply  # noqa: E402
from kvtier.scheduler_hooks import PlanKind, ReqState, Skip  # noqa: E402

BS, CHUNK = 16, 64
PROMPT = list(range(3, 3 + 4 * CHUNK + 10))


class StubClient:
    def __init__(self, tiers, chunk_load_ms=None, probed=()):
        self.tiers, self.chunk_load_ms, self.probed = tiers, chunk_load_ms or {}, list(probed)
        self.asked = 0  # lookups that named keys

    def lookup(self, keys, always=False):
        self.asked += bool(keys)
        return LookupReply(VERSION, self.tiers[: len(keys)], chunk_load_ms=self.chunk_load_ms, probed=self.probed)

    def close(self):
        pass


@pytest.fixture
def side():
    s = SchedulerSide(KvtierConfig(chunk_tokens=CHUNK, cpu_bytes=1 << 24), "model", BS, "ipc:///nonexistent")
    s.client = StubClient(["cpu"] * 4)
    yield s
    s.close()


def admit(side, req_id, local=0, blocks=None):
    plan = side.matched_tokens(req_id, PROMPT, None, local)
    side.allocated(req_id, blocks or list(range(100, 100 + len(PROMPT) // BS + 1)), plan.external_tokens)
    return plan


def slow_loads(side):
    for tokens in (1, 512) * 4:
        side.meter.record_step(tokens, 1e-3 + 1e-5 * tokens)  # recompute: 10 us a token
    for tokens in (64, 256) * 4:
        side.meter.record_load("cpu", tokens, 1.0)  # a load: a second


def test_load_commits_once_and_a_second_alloc_changes_nothing(side):
    plan = admit(side, "a")
    assert plan.kind is PlanKind.LOAD and side.state("a") is ReqState.WAITING_FOR_KV
    side.allocated("a", [1, 2, 3], plan.external_tokens)  # vLLM may call it twice
    (job,) = side.take_plan([]).loads
    assert len(job.keys) == 4 and job.first_block == 0 and len(job.block_ids) == 16


def test_with_veto_slower_loads_off_every_hit_loads():
    s = SchedulerSide(KvtierConfig(chunk_tokens=CHUNK, cpu_bytes=1 << 24, veto_slower_loads=False), "model", BS,
                      "ipc:///nonexistent")
    try:
        s.client = StubClient(["disk"] * 4, {"disk": 10.0, "cpu": 0.1}, ["disk"])  # 40 ms to load it
        s.meter.record_step(512, 512 * 1e-5)  # 2.6 ms to recompute it: vetoed, were vetoes on
        slow_loads(s)
        plan = admit(s, "a")
        assert plan.kind is PlanKind.LOAD and plan.external_tokens == 4 * CHUNK
    finally:
        s.close()


def test_cost_vetoes_are_probed_every_so_often(side):
    slow_loads(side)
    kinds = [admit(side, f"r{i}").kind for i in range(PROBE_EVERY + 1)]
    assert kinds[:PROBE_EVERY] == [PlanKind.NONE] * PROBE_EVERY
    assert kinds[PROBE_EVERY] is PlanKind.LOAD  # measures the tier again
    assert admit(side, "next").skip is Skip.SLOWER  # and the count starts over


@pytest.mark.parametrize("probed", [["disk"], []], ids=["probed", "negative control: not probed"])
def test_a_slow_probed_disk_is_vetoed_from_the_first_request_after_one_prefill_step(side, probed):
    side.meter.record_step(512, 512 * 1e-5)  # recompute: 10 us a token, 2.6 ms for the hit
    side.client = StubClient(["disk"] * 4, {"disk": 10.0, "cpu": 0.1}, probed)  # 40 ms to load it
    plan = admit(side, "a")
    assert (plan.skip is Skip.SLOWER) is bool(probed)
    side.client = StubClient(["disk"] * 4, {"disk": 0.1}, probed)  # a fast disk loads
    assert admit(side, "b").kind is PlanKind.LOAD


def test_a_failed_chunk_is_distrusted_until_saved_again(side):
    admit(side, "a")
    (job,) = side.take_plan([]).loads
    side.loads_reported({"a"}, set(job.block_ids[8:]))  # chunk 2 failed
    assert side.matched_tokens("b", PROMPT, None, 0).load_end == 2 * CHUNK  # stops before it
    side.scheduled("a", list(range(200, 217)), True, 4 * CHUNK)  # a recomputes and re-saves it
    assert side.matched_tokens("c", PROMPT, None, 0).load_end == 4 * CHUNK


def test_a_load_failed_at_the_first_token_goes_back_to_lookup(side):
    admit(side, "a")
    (job,) = side.take_plan([]).loads
    side.loads_reported({"a"}, set(job.block_ids))
    assert side.state("a") is ReqState.LOOKUP  # vLLM frees the blocks and looks it up again
    assert admit(side, "a").skip is Skip.NO_HIT  # its first chunk is distrusted: recompute
    assert side.state("a") is ReqState.RUNNING


def test_abort_while_waiting_is_done_only_after_the_report(side):
    admit(side, "a")
    side.take_plan([])
    side.finished("a")
    assert side.state("a") is ReqState.FINISHED_LOAD_PENDING
    side.loads_reported({"a"}, set())
    assert side.state("a") is None


def test_a_slow_shared_tier_is_vetoed_while_a_fast_cpu_tier_still_loads(side):
    """The shared tier's loads are measured like any tier's: one slower than recompute is
    vetoed, without touching loads from the tiers that are fast."""
    for tokens in (1, 512) * 4:
        side.meter.record_step(tokens, 1e-3 + 1e-5 * tokens)  # recompute: 10 us a token
    for tokens in (64, 256) * 4:
        side.meter.record_load("shared", tokens, 1.0)  # the shared server: a second a load
        side.meter.record_load("cpu", tokens, 1e-4)
    side.client = StubClient(["shared"] * 4)
    plan = admit(side, "far")
    assert plan.skip is Skip.SLOWER and plan.external_tokens == 0
    assert side.hit_sources("far") == {}
    side.client = StubClient(["cpu"] * 4)
    plan = admit(side, "near")
    assert plan.kind is PlanKind.LOAD and side.hit_sources("near") == {"cpu": 4 * CHUNK}


def test_a_shared_hit_is_planned_and_counted_as_shared(side):
    side.client = StubClient(["cpu", "shared", "shared", "shared"])
    plan = admit(side, "a")
    assert plan.kind is PlanKind.LOAD and plan.load_end == 4 * CHUNK
    assert side.hit_sources("a") == {"cpu": CHUNK, "shared": 3 * CHUNK}
    (job,) = side.take_plan([]).loads
    assert job.remote is None  # the workers read it from their store, not from a P/D producer


def test_a_request_preempted_by_vllms_own_scheduler_is_admitted_again_with_a_load(side):
    """vLLM's default scheduler preempts without telling the connector (only kvtier's scheduler
    calls preempted()). A preempted request that comes back with a hit used to raise
    IllegalTransition ('load' in state 'running') inside the engine loop and kill the engine;
    pinned end to end by test_abort_and_preemption_of_requests_parked_waiting_for_kvs_... ."""
    side.client = StubClient([])
    admit(side, "a")  # nothing stored yet: computed
    assert side.state("a") is ReqState.RUNNING
    side.take_plan([])
    side.client = StubClient(["cpu"] * 4)  # its chunks were saved meanwhile; then it was preempted
    plan = admit(side, "a")
    assert plan.kind is PlanKind.LOAD and side.state("a") is ReqState.WAITING_FOR_KV
    (job,) = side.take_plan([]).loads
    assert job.req_id == "a" and len(job.keys) == 4


def test_a_local_hit_that_leaves_no_load_asks_no_lookup(side):
    """With the engine's own cache holding every whole chunk but less than min_load_tokens (one
    chunk), no stored hit could load: rank 0 is not asked (at TP > 1 a trip to a busy worker)."""
    assert admit(side, "local", local=4 * CHUNK).kind is PlanKind.NONE
    assert admit(side, "almost", local=3 * CHUNK + BS).kind is PlanKind.NONE
    assert side.client.asked == 0
    assert admit(side, "one chunk short", local=3 * CHUNK).kind is PlanKind.LOAD
    assert side.client.asked == 1


def replied(side, req_id, reply_tokens):
    """A request with no hit computes its prompt, then decodes ``reply_tokens`` one step each;
    returns the chain keys its steps saved, in order."""
    side.client = StubClient([])
    plan = side.matched_tokens(req_id, PROMPT, None, 0)
    blocks = list(range(100, 100 + (len(PROMPT) + len(reply_tokens)) // BS + 1))
    side.allocated(req_id, blocks, plan.external_tokens)
    tokens = list(PROMPT)
    saved = list(side.scheduled(req_id, blocks, True, len(PROMPT), tokens=tokens).keys)
    for token in reply_tokens[:-1]:  # the last one sampled is never fed back: no KV
        tokens.append(token)  # sampled by the step before: this step computes its KV
        job = side.scheduled(req_id, None, False, len(tokens), tokens=tokens)
        saved += job.keys if job is not None else ()
    return saved


def test_a_reply_is_saved_chunk_by_chunk_under_the_keys_of_the_next_turns_prompt(side):
    from kvtier.keys import chunk_keys, namespace

    reply = list(range(7, 7 + 2 * CHUNK))  # fills the prompt's tail chunk and one more
    saved = replied(side, "a", reply)
    assert saved == chunk_keys(PROMPT + reply, CHUNK, namespace("model"))[:6]
    assert len(saved) == 6  # 4 of the prompt, 2 filled by the reply (its last token has no KV yet: 5 + 1)


def test_with_save_replies_off_only_the_prompt_is_saved():
    s = SchedulerSide(KvtierConfig(chunk_tokens=CHUNK, cpu_bytes=1 << 24, save_replies=False), "model", BS,
                      "ipc:///nonexistent")
    try:
        assert len(replied(s, "a", list(range(7, 7 + 2 * CHUNK)))) == 4
    finally:
        s.close()


def test_a_hit_in_cpu_then_on_a_slow_disk_loads_only_the_cpu_chunks(side):
    for tokens in (1, 512) * 4:
        side.meter.record_step(tokens, 1e-3 + 1e-5 * tokens)  # recompute: 10 us a token
    for tokens in (64, 256) * 4:
        side.meter.record_load("cpu", tokens, 1e-4)
        side.meter.record_load("disk", tokens, 1e-4 + 1e-4 * tokens)  # 100 us a token
    side.client = StubClient(["cpu", "cpu", "disk", "disk"])
    plan = admit(side, "a")
    assert (plan.kind, plan.load_end, plan.stored_end) == (PlanKind.LOAD, 2 * CHUNK, 4 * CHUNK)
    (job,) = side.take_plan([]).loads
    assert len(job.keys) == 2 and len(job.block_ids) == 2 * CHUNK // BS
    assert side.hit_sources("a") == {"cpu": 2 * CHUNK}
    side.client = StubClient(["disk"] * 4)  # a veto: every disk chunk is named for promotion
    assert admit(side, "b").skip is Skip.SLOWER
    assert side.take_plan([]).promotes == tuple(side._requests["b"].keys[:4])


def test_disk_chunks_a_cut_plan_leaves_are_named_for_promotion_once(side):
    for tokens in (1, 512) * 4:
        side.meter.record_step(tokens, 1e-3 + 1e-5 * tokens)
    for tokens in (64, 256) * 4:
        side.meter.record_load("cpu", tokens, 1e-4)
        side.meter.record_load("disk", tokens, 1e-4 + 1e-4 * tokens)
    side.client = StubClient(["cpu", "cpu", "disk", "disk"])
    admit(side, "a")
    plan = side.take_plan([])
    assert plan.promotes == tuple(side._requests["a"].keys[2:4])
    assert side.take_plan([]).promotes == ()
