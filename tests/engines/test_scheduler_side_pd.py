"""The scheduler half's P/D plans: what a producer publishes and returns, what a consumer loads.

The lookup client is replaced by a stub that answers from a list of tiers (and the producer's
chunk server addresses, as rank 0 would).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from kvtier.config import KvtierConfig  # noqa: E402
from kvtier.engines.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvtier.lookup.protocol import VERSION, LookupReply  # noqa: E402
from kvtier.scheduler_hooks import PlanKind, ReqState  # noqa: E402

BS, CHUNK = 16, 64
PROMPT = list(range(3, 3 + 4 * CHUNK + 10))  # four chunks and a 10-token tail
BLOCKS = list(range(100, 100 + 17))
ENDPOINTS = ["tcp://10.0.0.1:5000", "tcp://10.0.0.1:5001"]


class StubClient:
    def __init__(self, tiers):
        self.tiers = tiers

    def lookup(self, keys, always=False):
        if not keys and not always:  # as the real client: no round trip for nothing
            return None
        return LookupReply(VERSION, self.tiers[: len(keys)], endpoints=ENDPOINTS)

    def close(self):
        pass


@pytest.fixture
def make_side():
    made = []

    def make(tiers=(), tp_size=2):
        side = SchedulerSide(KvtierConfig(chunk_tokens=CHUNK, cpu_bytes=1 << 24), "model", BS, "ipc:///nonexistent",
                             engine_id="engine-p", tp_size=tp_size)
        side.client = StubClient(list(tiers))
        made.append(side)
        return side

    yield make
    for side in made:
        side.close()


def produce(side, req_id="p", params=None):
    params = params or {"do_remote_decode": True}
    plan = side.matched_tokens(req_id, PROMPT, None, 0, params)
    side.allocated(req_id, BLOCKS, plan.external_tokens)
    return plan


def consumer_params(**extra):
    return {"do_remote_prefill": True, "remote_request_id": "t1", "kvtier_endpoints": ENDPOINTS, "tp_size": 2,
            **extra}


def test_producer_publishes_every_step_and_the_tail_once_all_is_computed(make_side):
    side = make_side()
    produce(side)
    first = side.scheduled("p", BLOCKS, True, 2 * CHUNK + 5)
    assert first.publish == "p" and len(first.keys) == 2 and not first.final
    assert side.scheduled("p", None, False, 2 * CHUNK + 20).keys == ()  # nothing new: still a sign of life
    last = side.scheduled("p", None, False, len(PROMPT))
    assert last.final and len(last.keys) == 3  # chunks 2 and 3, and the tail
    assert last.block_ids == tuple(BLOCKS[8:17])  # the tail's one partial block included
    assert side.scheduled("p", None, False, len(PROMPT) + 1) is None  # decoding publishes nothing


def test_producer_returns_what_the_consumer_needs_when_it_completes(make_side):
    side = make_side()
    produce(side, params={"do_remote_decode": True, "transfer_id": "shared"})
    side.scheduled("p", BLOCKS, True, len(PROMPT))
    params = side.finished("p", completed=True)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_request_id"] == "shared" and params["remote_engine_id"] == "engine-p"
    assert (params["remote_host"], params["remote_port"], params["tp_size"]) == ("10.0.0.1", 5000, 2)
    assert params["kvtier_endpoints"] == ENDPOINTS
    assert params["remote_block_ids"] is None  # not lent: D waits for P's reply to name blocks


def test_a_producer_that_lends_its_blocks_names_them_and_the_consumer_reads_them_from_its_first_fetched_chunk(make_side):
    """P's blocks go in the params (vLLM's ``remote_block_ids``) where they are lent, and D's load
    carries them from the first chunk it fetches from P on (chunk 1 here: chunk 0 is in D's CPU tier)."""
    p = make_side()
    produce(p)
    p.scheduled("p", BLOCKS, True, len(PROMPT))
    before = time.time()
    params = p.finished("p", completed=True, lent=BLOCKS)
    assert params["remote_block_ids"] == BLOCKS
    lease_s = p.config.pd_hbm_lease_ms / 1000
    assert before + lease_s - 0.01 <= params["kvtier_lent_until"] <= time.time() + lease_s + 0.01
    d = make_side(tiers=["cpu"])
    plan = d.matched_tokens("d", PROMPT, None, 0, {**params, "tp_size": 2})
    d.allocated("d", list(range(200, 217)), plan.external_tokens)
    (job,) = d.take_plan([]).loads
    assert job.remote.first_chunk == 1 and job.remote.blocks == tuple(BLOCKS[CHUNK // BS:])


def test_a_consumer_asking_after_the_lease_ended_does_not_read_the_blocks_named(make_side):
    """P's lease of them has ended (P said until when): D goes to P's CPU tier without reading them first."""
    d = make_side()
    params = consumer_params(remote_block_ids=BLOCKS, kvtier_lent_until=time.time() - 0.1)
    plan = d.matched_tokens("d", PROMPT, None, 0, params)
    d.allocated("d", BLOCKS, plan.external_tokens)
    (job,) = d.take_plan([]).loads
    assert job.remote is not None and job.remote.blocks == ()


@pytest.mark.parametrize("named", [[1, -2], ["3"], [[1], [2]], list(range(3)) * 0, {"0": 1}, [True, 1]])
def test_block_ids_a_consumer_cannot_use_are_not_named_and_the_transfer_goes_on(make_side, named):
    d = make_side()
    plan = d.matched_tokens("d", PROMPT, None, 0, consumer_params(remote_block_ids=named))
    d.allocated("d", BLOCKS, plan.external_tokens)
    (job,) = d.take_plan([]).loads
    assert job.remote is not None and job.remote.blocks == ()


class LateClient(StubClient):
    """Rank 0's lookup before every rank announced its chunk server: no endpoints yet."""

    announced = False

    def lookup(self, keys, always=False):
        reply = super().lookup(keys, always)
        return reply if reply is None or self.announced else LookupReply(VERSION, reply.tiers, endpoints=[])


def test_a_producer_admitted_before_every_rank_announced_its_server_still_publishes(make_side):
    """Regression: at TP=2 the first request after start could finish with no params (D recomputed)."""
    side = make_side()
    side.client = LateClient([])
    produce(side)
    side.scheduled("p", BLOCKS, True, len(PROMPT))
    assert side.peer_endpoints == [] and side.published("p") is None  # still unannounced: nothing to lend
    side.client.announced = True
    assert side.published("p")[0] == "p"
    assert side.finished("p", completed=True)["kvtier_endpoints"] == ENDPOINTS


def test_aborted_producer_returns_nothing(make_side):
    side = make_side()
    produce(side)
    assert side.finished("p", completed=False) is None


def test_plain_request_publishes_nothing(make_side):
    side = make_side()
    side.matched_tokens("a", PROMPT, None, 0)
    side.allocated("a", BLOCKS, 0)
    job = side.scheduled("a", BLOCKS, True, len(PROMPT))
    assert job.publish is None and len(job.keys) == 4
    assert side.finished("a") is None


def test_consumer_loads_own_tiers_then_the_producer_through_the_last_partial_block(make_side):
    side = make_side(tiers=["cpu"])
    plan = side.matched_tokens("d", PROMPT, None, 0, consumer_params())
    assert plan.kind is PlanKind.REMOTE and plan.external_tokens == len(PROMPT)
    side.allocated("d", BLOCKS, plan.external_tokens)
    assert side.state("d") is ReqState.WAITING_FOR_KV
    (job,) = side.take_plan([]).loads
    assert len(job.keys) == 5 and job.tail_blocks == 1 and job.block_ids == tuple(BLOCKS)
    assert job.remote.first_chunk == 1 and job.remote.endpoints == tuple(ENDPOINTS) and not job.remote.wait
    assert side.hit_sources("d") == {"cpu": CHUNK, "remote": len(PROMPT) - CHUNK}


def test_consumer_after_a_local_hit_starts_there(make_side):
    side = make_side()
    plan = side.matched_tokens("d", PROMPT, None, 3 * BS, consumer_params(transfer_id="t1"))
    side.allocated("d", BLOCKS, plan.external_tokens)
    (job,) = side.take_plan([]).loads
    assert job.first_block == 3 and job.block_ids == tuple(BLOCKS[3:]) and job.remote.wait


def test_full_local_hit_transfers_nothing(make_side):
    side = make_side()
    floor = (len(PROMPT) - 1) // BS * BS
    assert side.matched_tokens("d", PROMPT, None, floor, consumer_params()).kind is PlanKind.NONE


def test_a_producer_of_another_tp_size_is_read(make_side):
    side = make_side(tp_size=1)  # its ranks gather their heads from P's two (kvtier.pd.consumer.gather)
    assert side.matched_tokens("d", PROMPT, None, 0, consumer_params()).kind is not PlanKind.NONE


def test_endpoints_that_do_not_match_the_tp_size_recompute_with_one_line(make_side, caplog):
    side = make_side(tp_size=1)
    params = consumer_params(kvtier_endpoints=ENDPOINTS[:1])
    assert side.matched_tokens("d", PROMPT, None, 0, params).kind is PlanKind.NONE
    assert "names 1 chunk servers for a producer of 2 TP ranks" in caplog.text


def test_failed_transfer_is_never_retried(make_side):
    side = make_side()
    plan = side.matched_tokens("d", PROMPT, None, 0, consumer_params())
    side.allocated("d", BLOCKS, plan.external_tokens)
    (job,) = side.take_plan([]).loads
    side.loads_reported({"d"}, set(job.block_ids))  # the producer was gone
    assert side.state("d") is ReqState.LOOKUP
    assert side.matched_tokens("d", PROMPT, None, 0, consumer_params()).kind is PlanKind.NONE  # recompute


def test_consumer_saves_its_loaded_prompt_after_the_first_token(make_side):
    side = make_side()
    plan = side.matched_tokens("d", PROMPT, None, 0, consumer_params())
    side.allocated("d", BLOCKS, plan.external_tokens)
    side.take_plan([])
    side.loads_reported({"d"}, set())
    assert side.scheduled("d", BLOCKS, True, len(PROMPT)) is None  # the first token's step copies nothing out
    job = side.scheduled("d", [], False, len(PROMPT) + 1)
    assert job.keys == tuple(side._requests["d"].keys) and job.block_ids == tuple(BLOCKS[: 4 * CHUNK // BS])


def test_a_consumer_whose_transfer_failed_saves_what_it_recomputes_at_once(make_side):
    side = make_side()
    plan = side.matched_tokens("d", PROMPT, None, 0, consumer_params())
    side.allocated("d", BLOCKS, plan.external_tokens)
    side.take_plan([])
    side.loads_reported({"d"}, set(BLOCKS[CHUNK // BS :]))  # the first chunk landed, the rest failed
    job = side.scheduled("d", BLOCKS, True, len(PROMPT))
    assert len(job.keys) == 4


@pytest.mark.parametrize("params", [
    {"do_remote_prefill": True},  # names no producer
    {"do_remote_prefill": True, "remote_request_id": "t", "kvtier_endpoints": ["http://x"]},
    {"do_remote_prefill": True, "remote_request_id": "t" * 1000, "kvtier_endpoints": ENDPOINTS},
    {"do_remote_decode": True, "transfer_id": 7},
])
def test_malformed_transfer_params_are_plain_requests(make_side, params):
    side = make_side()
    plan = side.matched_tokens("d", PROMPT, None, 0, params)
    assert plan.kind is not PlanKind.REMOTE
    side.allocated("d", BLOCKS, plan.external_tokens)
    assert side.scheduled("d", BLOCKS, True, len(PROMPT)).publish is None


def test_abort_while_waiting_for_the_producer_cancels_the_transfer(make_side):
    side = make_side()
    plan = side.matched_tokens("d", PROMPT, None, 0, consumer_params(transfer_id="t1"))
    side.allocated("d", BLOCKS, plan.external_tokens)
    assert side.take_plan([]).cancels == ()
    side.finished("d", completed=False)
    assert side.state("d") is ReqState.FINISHED_LOAD_PENDING  # blocks stay until the worker reports
    assert side.take_plan([]).cancels == ("d",)
    side.loads_reported({"d"}, set(BLOCKS))
    assert side.state("d") is None


def test_producer_of_a_prompt_shorter_than_a_chunk_still_names_its_servers(make_side):
    side = make_side()
    short = PROMPT[:40]
    plan = side.matched_tokens("p", short, None, 0, {"do_remote_decode": True})
    side.allocated("p", BLOCKS[:3], plan.external_tokens)
    job = side.scheduled("p", BLOCKS[:3], True, len(short))
    assert job.final and len(job.keys) == 1 and job.block_ids == tuple(BLOCKS[:3])  # the tail alone
    assert side.finished("p")["kvtier_endpoints"] == ENDPOINTS


def test_aborted_producer_withdraws_its_transfer_once(make_side):
    side = make_side()
    produce(side, params={"do_remote_decode": True, "transfer_id": "shared"})
    side.scheduled("p", BLOCKS, True, CHUNK)
    assert side.finished("p", completed=False) is None
    assert side.take_plan([]).withdrawn == ("shared",)
    assert side.take_plan([]).withdrawn == ()


# ---- hybrid models: every served group's chunks travel (full attention + a 32-token window) ----
HYBRID_PROMPT = list(range(3, 3 + 4 * CHUNK + 40))  # four chunks and a 40-token tail (3 blocks)


def hybrid_side(tiers=(), other=None):
    from kvtier.engines.vllm.groups import ServedGroup

    other = other or ServedGroup(1, "sliding_window", 2 * BS)
    side = SchedulerSide(KvtierConfig(chunk_tokens=CHUNK, cpu_bytes=1 << 24), "model", BS, "ipc:///nonexistent",
                         engine_id="engine-p", tp_size=2, groups=(ServedGroup(0, "full_attention"), other))
    side.client = StubClient(list(tiers))
    return side


def test_hybrid_producer_publishes_every_group_and_each_ones_tail():
    """Each group's chunks go out under the transfer, the other group's first in the step's plan
    (the anchor's final job then says everything is announced)."""
    from kvtier.keys import group_key

    side = hybrid_side()
    try:
        blocks, window = list(range(100, 119)), list(range(200, 219))
        plan = side.matched_tokens("p", HYBRID_PROMPT, None, 0, {"do_remote_decode": True})
        side.allocated("p", blocks, plan.external_tokens, (window,))
        anchor = side.scheduled("p", blocks, True, len(HYBRID_PROMPT), (window,), 0)
        saves = side.take_plan([anchor]).saves
        assert [(job.group, job.publish, job.final) for job in saves] == [(1, "p/1", True), (0, "p", True)]
        assert saves[1].final and saves[1].keys[-1] == side._requests["p"].tail
        assert saves[0].keys == tuple(group_key(k, 1) for k in saves[1].keys)
        assert saves[0].block_ids == tuple(window)  # every chunk (all in the window at the step's start), tail too
    finally:
        side.close()


def test_hybrid_consumer_stops_a_block_short_and_loads_the_window_from_the_producer():
    """vLLM gives a windowed group only the blocks its window reads past the whole prompt, then
    runs the last token again: a hybrid consumer loads through the last full block before the
    prompt's last token, the window group only its window, the tail as stored (3 blocks)."""
    from kvtier.engines.vllm.groups import NULL_BLOCK
    from kvtier.keys import group_key

    side = hybrid_side(tiers=["cpu"])
    try:
        plan = side.matched_tokens("d", HYBRID_PROMPT, None, 0, consumer_params())
        end = (len(HYBRID_PROMPT) - 1) // BS * BS
        assert plan.kind is PlanKind.REMOTE and plan.load_end == end == 4 * CHUNK + 2 * BS
        blocks, window = list(range(100, 118)), [NULL_BLOCK] * 16 + [216, 217]  # as vLLM allocates at `end`
        side.allocated("d", blocks, plan.external_tokens, (window,))
        anchor, group = sorted(side.take_plan([]).loads, key=lambda j: j.group)
        tail = side._requests["d"].tail
        assert anchor.block_ids == tuple(blocks) and anchor.tail_blocks == 3 and anchor.remote.first_chunk == 1
        assert (group.keys, group.first_block, group.block_ids, group.tail_blocks) == (
            (group_key(tail, 1),), 0, (216, 217), 3)
        assert group.remote.first_chunk == 0 and group.remote.transfer_id == anchor.remote.transfer_id + "/1"
    finally:
        side.close()


def _mamba_producer():
    """P's scheduler half of a Mamba hybrid (align mode) with ``HYBRID_PROMPT`` admitted as a P/D
    producer: (the side, its blocks, its Mamba group's blocks, the prompt's chunk keys)."""
    from kvtier.engines.vllm.groups import MAMBA, ServedGroup

    side = hybrid_side(other=ServedGroup(1, MAMBA))
    blocks, states = list(range(100, 119)), list(range(200, 219))
    plan = side.matched_tokens("p", HYBRID_PROMPT, None, 0, {"do_remote_decode": True})
    side.allocated("p", blocks, plan.external_tokens, (states,))
    return side, blocks, states, side._requests["p"].keys


def test_mamba_hybrid_pd_moves_the_state_at_the_consumers_last_chunk_end():
    """Mamba state in align mode: P publishes a state where a step ended at a chunk's end, and
    every step's job says its group transfer is alive, the last one that it is done; D loads
    through the last chunk end before the prompt's last token and that chunk's state."""
    from kvtier.engines.vllm.groups import MAMBA, NULL_BLOCK, ServedGroup
    from kvtier.keys import group_key

    side, blocks, states, keys = _mamba_producer()
    try:
        first = side.scheduled("p", blocks, True, 2 * CHUNK, (states,), 0)  # a step ends at chunk 1's end
        saves = side.take_plan([first]).saves
        assert [(job.group, job.publish, job.final, job.keys) for job in saves[:1]] == [
            (1, "p/1", False, (group_key(keys[1], 1),))]
        assert saves[0].block_ids == (states[2 * CHUNK // BS - 1],)
        last = side.scheduled("p", [], False, len(HYBRID_PROMPT), ((),), 2 * CHUNK)  # ends mid-chunk: no state
        saves = side.take_plan([last]).saves
        assert [(job.group, job.publish, job.final, job.keys) for job in saves[:1]] == [(1, "p/1", True, ())]

        d = hybrid_side(tiers=["cpu"], other=ServedGroup(1, MAMBA))
        plan = d.matched_tokens("d", HYBRID_PROMPT, None, 0, consumer_params())
        assert plan.kind is PlanKind.REMOTE and plan.load_end == 4 * CHUNK  # the last chunk end before the last token
        state_ids = [NULL_BLOCK] * 15 + [216]  # as vLLM allocates at the hit's end
        d.allocated("d", blocks[:16], plan.external_tokens, (state_ids,))
        anchor, state = sorted(d.take_plan([]).loads, key=lambda j: j.group)
        assert anchor.keys == tuple(d._requests["d"].keys) and anchor.tail_blocks == 0
        assert (state.keys, state.block_ids) == ((group_key(d._requests["d"].keys[3], 1),), (216,))
        assert state.remote.first_chunk == 0 and state.remote.transfer_id == anchor.remote.transfer_id + "/1"
        d.close()
    finally:
        side.close()


def test_mamba_hybrid_producer_publishes_the_state_vllm_names_inside_its_last_step():
    """vLLM >= 0.32's Mamba-2 layers write the state at the prompt's last chunk end (what D loads
    through) inside a step that runs on to the prompt's end: P publishes it from the block vLLM
    names, in its final job."""
    from kvtier.keys import group_key

    side, blocks, states, keys = _mamba_producer()
    try:
        one_step = side.scheduled("p", blocks, True, len(HYBRID_PROMPT), (states,), 0, [(1, 777, 4 * CHUNK)])
        (job,) = [j for j in side.take_plan([one_step]).saves if j.group == 1]
        assert (job.publish, job.final, job.keys, job.block_ids) == ("p/1", True, (group_key(keys[3], 1),), (777,))
    finally:
        side.close()


def test_a_parked_requests_blocks_are_among_the_steps_given_out_blocks(make_side):
    """Regression: a request parked for its transfer is not among the step's scheduled requests, yet
    its blocks are written from this step on (NIXL, or the load stream): the workers' reuse guard
    must see them, else a deferred save still reading them saves the new request's KV."""
    d = make_side()
    plan = d.matched_tokens("d", PROMPT, None, 0, consumer_params())
    d.allocated("d", BLOCKS, plan.external_tokens)
    step = d.take_plan([], allocated=(7,))
    (job,) = step.loads
    assert set(job.block_ids) and set(job.block_ids) <= set(step.allocated) and 7 in step.allocated


@pytest.mark.parametrize("how", ["preempted", "aborted"])
def test_a_producer_request_preempted_or_aborted_stops_lending_its_blocks_with_the_next_step(make_side, how):
    """Its blocks go back to vLLM: the workers must hear of it before that step's kernels (plan.stopped)."""
    p = make_side()
    produce(p)
    p.scheduled("p", BLOCKS, True, 2 * CHUNK)
    p.take_plan([])
    if how == "preempted":
        p.preempted("p")
    else:
        p.finished("p", completed=False)
    plan = p.take_plan([])
    assert plan.stopped == ("p",)
    assert plan.withdrawn == (("p",) if how == "aborted" else ())  # preempted: it computes again, publishes again
    assert p.take_plan([]).stopped == ()
