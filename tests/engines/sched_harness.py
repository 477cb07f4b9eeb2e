"""The real vLLM ``Scheduler`` (kvtier's subclass, kvtier's connector) driven in-process.

No model runs: :meth:`Harness.step` stands in for the workers. It "computes" scheduled tokens by
writing, per engine block, which token prefix each slot holds (a shadow of the KV bytes), runs
the step's loads and saves against :attr:`Harness.index` (the stored chunks, reported to a real
``LookupServer`` that answers the connector's lookups), and reports finished and failed loads
through ``ModelRunnerOutput(kv_connector_output=KVConnectorOutput(...))`` like the worker half.

Every check raises :class:`InvariantError` naming the request and block; a hypothesis state
machine (``test_scheduler_machine.py``) and targeted tests (``test_scheduler.py``) use it.

``window``: a hybrid model, a full-attention group and a sliding-window group of ``window``
tokens (vLLM's hybrid KV cache manager, two block tables over one pool). The sliding group is
checked where its attention reads (the window before every computed position), its saves must
hold exactly their chunk's tokens (never a block vLLM freed out of the window), and its loads
fill exactly the window's blocks; a failed load is reported per request, as the workers do.

``mamba``: a hybrid model of a full-attention group and Mamba state in vLLM's align mode (the
scheduler ends prefill steps where a state is cached). Each step must start from the state after
its first token's prefix, read where vLLM's workers read it (the block before it for a request
new to them, else the block the last step wrote), and leaves the state after its last token in
its running block; a saved state must be the one at its chunk's end, a loaded one land in the
block vLLM gives the hit's end.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections import Counter
from dataclasses import dataclass, field

from sched_setup import VOCAB, Index, lookup_server, vllm_config  # first: quiets vLLM's logging

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvtier.engines.vllm.groups import NULL_BLOCK  # noqa: E402
from kvtier.engines.vllm.scheduler import KvtierScheduler  # noqa: E402
from kvtier.engines.vllm.compat import KVConnectorTransferResults  # noqa: E402
from kvtier.engines.vllm.stats import FAILED_REQUESTS, KvtierStats  # noqa: E402
from kvtier.keys import chunk_keys, group_key, namespace, tail_key  # noqa: E402
from kvtier.lookup.index import HoldIndex  # noqa: E402

__all__ = ["VOCAB", "Harness", "InvariantError"]
STEP_FIXED_S = 1e-3  # simulated engine step: fixed cost ...
STEP_TOKEN_S = 100e-6  # ... plus this per scheduled token (a 10k tokens/s prefill)


class InvariantError(AssertionError):
    """A safety or liveness property of kvtier + vLLM does not hold."""


@dataclass
class _Pending:
    job: object  # LoadJob
    lag: int  # steps until it runs (0: during this step)
    fail_at: int | None  # chunk index (in job.keys) where it fails on purpose, None: only real misses
    start: int  # first token position it writes


@dataclass
class Stats:
    engine_steps: int = 0
    loads: Counter = field(default_factory=Counter)  # by kind: load, partial, handoff
    failed_loads: int = 0
    evicted_before_load: int = 0
    aborted_while_waiting: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    resumed_checked: int = 0
    plans: Counter = field(default_factory=Counter)  # admission plans by kind or skip reason
    idle_steps: int = 0  # steps that computed nothing (the workers may wait for their loads)


class Harness:
    """One scheduler, its simulated workers and its store. ``num_blocks`` includes vLLM's null block."""

    def __init__(self, block_size: int = 16, chunk_tokens: int = 64, num_blocks: int = 48, unaligned: str = "auto",
                 min_load_tokens: int | None = None, max_num_seqs: int = 4, max_batched: int = 128,
                 store_chunks: int = 24, seed: int = 0, reserve_full: bool = True,
                 scheduler_cls: type = KvtierScheduler, window: int = 0, mamba: bool = False):
        self.block_size, self.chunk_tokens, self.num_blocks = block_size, chunk_tokens, num_blocks
        self.window, self.mamba = window, mamba
        self.num_groups = 2 if window or mamba else 1
        self.chunk_blocks = chunk_tokens // block_size
        self.store_chunks = store_chunks
        config = vllm_config(block_size, chunk_tokens, unaligned, min_load_tokens, max_num_seqs, max_batched,
                             reserve_full)
        config.cache_config.num_gpu_blocks = num_blocks
        if mamba:
            config = copy.copy(config)
            config.cache_config = copy.copy(config.cache_config)
            config.cache_config.mamba_cache_mode = "align"
        groups = [KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=16,
                                                                dtype=torch.float32))]
        if window:
            groups.append(KVCacheGroupSpec(["swa"], SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=16,
                                                                      dtype=torch.float32, sliding_window=window)))
        if mamba:
            groups.append(KVCacheGroupSpec(["mixer"], MambaSpec(block_size=block_size, shapes=((4,), (4,)),
                                                                dtypes=(torch.float32, torch.float32),
                                                                mamba_cache_mode="align")))
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        _, server = lookup_server()
        server.index = HoldIndex(1)
        self.index = Index(server)
        self.sched = scheduler_cls(vllm_config=config, kv_cache_config=kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(config),
                                   block_size=block_size, log_stats=False)
        self.side = self.sched.connector.scheduler_side
        self.now = 0.0
        self.side.clock = lambda: self.now
        matched = self.side.matched_tokens

        def counted(*args):
            plan = matched(*args)
            self.stats.plans[plan.skip.name if plan.skip else plan.kind.name] += 1
            return plan
        self.side.matched_tokens = counted
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(block_size, hash_fn)
        self._root = namespace(config.model_config.model, None)
        self.pool = self.sched.kv_cache_manager.block_pool
        self.shadow: dict[int, tuple] = {}  # block id -> per-slot prefix hashes it holds
        self.pending: list[_Pending] = []
        self.requests: dict[str, Request] = {}  # every request ever added
        self.prefix: dict[str, list] = {}  # req id -> prefix hashes ph[n] of its first n tokens
        self.keys: dict[str, list[bytes]] = {}
        self.parts: dict[str, list] = {}  # hybrid: req id -> [load jobs not run, failed, anchor tokens loaded]
        self.expect_resume: dict[str, int] = {}  # req id -> computed tokens it must resume with
        self.fail_next: set[bytes] = set()  # chunk keys whose next load fails (corrupt)
        self.stale: bool = False  # a failed chunk stays in the index (a stale lookup index)
        self.rng = random.Random(seed)
        self.stats = Stats()
        self._ids = itertools.count()
        self.broken = False  # a step raised: the scheduler is mid-step, only close() is safe
        self.on_workers: set[str] = set()  # requests the (simulated) workers hold state for
        self.state_block: dict[str, int] = {}  # mamba: req id -> block its last step left its state in

    # ---- driving ----------------------------------------------------------------------------
    def add(self, prompt: list[int], max_tokens: int = 2, remote: bool = False) -> str:
        """A request; ``remote``: a P/D consumer whose prompt a (simulated) producer computed."""
        req_id = f"r{next(self._ids)}"
        params = {"do_remote_prefill": True, "remote_request_id": f"p-{req_id}", "tp_size": 1,
                  "kvtier_endpoints": ["tcp://127.0.0.1:9"]} if remote else None
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                  extra_args={"kv_transfer_params": params} if remote else None)
        request = Request(req_id, list(prompt), sampling, None, block_hasher=self._hasher)
        self.requests[req_id] = request
        keys = chunk_keys(prompt, self.chunk_tokens, self._root)
        tail = tail_key(prompt, self.chunk_tokens, self._root, keys) if remote else None
        self.keys[req_id] = keys + ([tail] if tail else [])
        self.sched.add_request(request)
        return req_id

    def abort(self, req_id: str) -> None:
        request = self.requests[req_id]
        if request.is_finished():
            return
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.stats.aborted_while_waiting += 1
        self.sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        self.stats.aborted += 1
        self.expect_resume.pop(req_id, None)

    def evict_local(self, block_id: int) -> None:
        """The engine's prefix cache forgets one unreferenced block (its LRU eviction, anywhere)."""
        self.pool.evict_blocks({block_id})

    def forget_from(self, prompt: list[int], first_block: int) -> None:
        """Evict the engine's unreferenced cached blocks holding ``prompt``'s blocks from
        ``first_block`` on, so its local floor is at most ``first_block`` blocks."""
        ph, bs = [0], self.block_size
        for token in prompt:
            ph.append(hash((ph[-1], token)))
        wanted = {ph[(j + 1) * bs] for j in range(first_block, len(prompt) // bs)}
        for block_id in self.evictable_local():
            held = self.shadow.get(block_id, ())
            if len(held) == bs and held[-1] in wanted:
                self.evict_local(block_id)

    def evictable_local(self) -> list[int]:
        return [b.block_id for b in self.pool.blocks if not b.is_null and not b.ref_cnt and b.block_hash is not None]

    def live(self) -> list[str]:
        return [r for r, req in self.requests.items() if not req.is_finished()]

    def step(self, lags: list[int] | None = None, fail_prob: float = 0.0) -> None:
        """One engine step. ``lags``: steps each new load takes (drawn from ``self.rng`` if None)."""
        if self.broken:
            raise InvariantError("an earlier step failed; the scheduler state is unusable")
        self.broken = True  # until this step completes
        out = self.sched.schedule()
        self.stats.engine_steps += 1
        self.stats.preemptions += len(out.preempted_req_ids or ())
        self._check_new_to_workers(out)
        # A forward writes every scheduled token's KV before any attention reads it, so a
        # prefix-cache hit on a block another request fills in the same step is valid.
        self._forward(out)
        self._check_computed(out)
        meta = out.kv_connector_metadata
        if meta.idle != (out.total_num_scheduled_tokens == 0):
            raise InvariantError(f"a step of {out.total_num_scheduled_tokens} tokens told the workers idle={meta.idle}")
        self.stats.idle_steps += meta.idle
        for i, job in enumerate(meta.plan.loads):
            lag = lags[i % len(lags)] if lags else self.rng.choice((0, 0, 0, 1, 2, 4))
            fail_at = self.rng.randrange(len(job.keys)) if self.rng.random() < fail_prob else None
            self.pending.append(_Pending(job, lag, fail_at, self._check_load_targets(job)))
            if self.num_groups > 1:
                self.parts.setdefault(job.req_id, [0, False, 0])[0] += 1
        for save in meta.plan.saves:
            self._save(save)
        finished, invalid, failed = self._run_loads()
        self.now += STEP_FIXED_S + STEP_TOKEN_S * out.total_num_scheduled_tokens
        self.sched.update_from_output(out, self._runner_output(out, finished, invalid, failed))
        for req_id, request in self.requests.items():
            if request.is_finished() and req_id in self.prefix:
                self.stats.finished += request.status == RequestStatus.FINISHED_LENGTH_CAPPED
                del self.prefix[req_id]
        self.check_blocks()
        self.broken = False

    def drain(self, max_steps: int = 400) -> None:
        """Let every load finish and every request end; liveness: within ``max_steps``."""
        for _ in range(max_steps):
            if not self.sched.has_requests() and not self.pending:
                return
            self.step(lags=[0])
            for p in self.pending:
                p.lag = 0
        live = {r: (req.status.name, req.num_computed_tokens, req.num_tokens) for r, req in self.sched.requests.items()}
        raise InvariantError(f"not every request ended within {max_steps} steps: {live}; "
                             f"pending loads {[p.job.req_id for p in self.pending]}")

    def check_quiescent(self) -> None:
        """After :meth:`drain`: every block is back, nothing is tracked, every request ended."""
        free = self.pool.get_num_free_blocks()
        if free != self.num_blocks - 1:  # the null block is never free
            raise InvariantError(f"{self.num_blocks - 1 - free} blocks leaked after every request ended")
        held = [b.block_id for b in self.pool.blocks if not b.is_null and b.ref_cnt]
        if held:
            raise InvariantError(f"blocks {held} still referenced after every request ended")
        if self.side._requests:
            raise InvariantError(f"kvtier still tracks {sorted(self.side._requests)} after they ended")
        if self.sched.requests:
            raise InvariantError(f"vLLM still holds {sorted(self.sched.requests)}")
        if self.side._loads:
            raise InvariantError("kvtier planned loads that never left in a step")

    # ---- invariants -------------------------------------------------------------------------
    def check_blocks(self) -> None:
        """No block freed twice: reference counts never negative, free queue = unreferenced blocks."""
        unreferenced = 0
        for block in self.pool.blocks:
            if block.is_null:
                continue
            if block.ref_cnt < 0:
                raise InvariantError(f"block {block.block_id} freed more often than allocated "
                                     f"(ref_cnt {block.ref_cnt})")
            unreferenced += block.ref_cnt == 0
        if unreferenced != self.pool.get_num_free_blocks():
            raise InvariantError(f"{self.pool.get_num_free_blocks()} free blocks queued but "
                                 f"{unreferenced} unreferenced")

    def _ph(self, req_id: str) -> list:
        """Prefix hashes: ``ph[n]`` identifies the request's first ``n`` tokens (the KV of token n-1)."""
        request = self.requests[req_id]
        ph = self.prefix.setdefault(req_id, [0])
        tokens = request.all_token_ids
        while len(ph) <= len(tokens):
            ph.append(hash((ph[-1], tokens[len(ph) - 1])))
        return ph

    def _check_new_to_workers(self, out) -> None:
        """Workers keep a request's state from its first step until it finishes or is preempted;
        sending it again as new (rather than resumed) would corrupt their batch."""
        self.on_workers -= set(out.finished_req_ids) | set(out.preempted_req_ids or ())
        for new in out.scheduled_new_reqs:
            if new.req_id in self.on_workers:
                raise InvariantError(f"{new.req_id} was sent as a new request but the workers already hold it")
        self.on_workers |= set(out.num_scheduled_tokens)

    def _blocks(self, req_id: str, group: int = 0) -> list[int]:
        return self.sched.kv_cache_manager.get_block_ids(req_id)[group]

    def _keys(self, req_id: str, group: int = 0) -> list[bytes]:
        """The request's chain keys: its prompt's (P/D: and its tail's), then those its reply filled
        (``save_replies``: the anchor group of a request with no role saves them too)."""
        keys = self.keys[req_id]
        if group:
            return [group_key(k, group) for k in keys]
        if self.requests[req_id].kv_transfer_params is None:
            keys = chunk_keys(self.requests[req_id].all_token_ids, self.chunk_tokens, self._root, keys)
        return keys

    def _window_start(self, computed: int) -> int:
        """First block the sliding group's attention reads once ``computed`` tokens are computed."""
        return max(0, computed - self.window + 1) // self.block_size

    def _check_computed(self, out) -> None:
        """Every scheduled request's computed tokens are really in its blocks; a request that
        waited for a load resumes with exactly its floor plus what was loaded."""
        scheduled = [(new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, computed in scheduled:
            expected = self.expect_resume.pop(req_id, None)
            request = self.requests[req_id]
            if expected is not None and expected > 0:
                want = min(expected, request.num_tokens - 1)
                if computed != want:
                    raise InvariantError(f"{req_id} resumed with {computed} computed tokens, "
                                         f"expected floor + loaded = {want}")
                self.stats.resumed_checked += 1
            ph, bs = self._ph(req_id), self.block_size
            for group in range(1 if self.mamba else self.num_groups):  # Mamba state: checked by _forward
                blocks = self._blocks(req_id, group)
                for j in range(self._window_start(computed) if group else 0, -(-computed // bs)):
                    need = min(bs, computed - j * bs)
                    held = self.shadow.get(blocks[j], ()) if blocks[j] != NULL_BLOCK else ()
                    if len(held) < need or held[need - 1] != ph[j * bs + need]:
                        raise InvariantError(f"{req_id}: group {group} block {blocks[j]} (#{j}) does not hold tokens "
                                             f"[{j * bs}, {j * bs + need}) it counts as computed ({computed})")

    def _forward(self, out) -> None:
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        fresh = {new.req_id for new in out.scheduled_new_reqs} | set(cached.resumed_req_ids)
        bs = self.block_size
        for req_id, n in out.num_scheduled_tokens.items():
            start, end = starts[req_id], starts[req_id] + n
            ph = self._ph(req_id)
            if self.mamba:
                self._run_state(req_id, start, end, req_id in fresh)
            for group in range(1 if self.mamba else self.num_groups):
                blocks = self._blocks(req_id, group)
                for j in range(start // bs, -(-end // bs)):
                    if blocks[j] == NULL_BLOCK:
                        raise InvariantError(f"{req_id}: group {group} computes tokens of block #{j} into the null block")
                    lo, hi = j * bs, min((j + 1) * bs, end)
                    prev = self.shadow.get(blocks[j], ())[: max(0, start - lo)]
                    self.shadow[blocks[j]] = tuple(prev) + tuple(ph[p + 1] for p in range(max(lo, start), hi))

    def _run_state(self, req_id: str, start: int, end: int, fresh: bool) -> None:
        """Mamba state in align mode: the step reads the state after ``start`` tokens (from the
        block before ``start`` for a request new to the workers, else from where its last step
        left it) and leaves the state after ``end`` tokens in its running block."""
        ph, bs, blocks = self._ph(req_id), self.block_size, self._blocks(req_id, 1)
        if start:
            prev = blocks[(start - 1) // bs] if fresh else self.state_block[req_id]
            if prev == NULL_BLOCK or self.shadow.get(prev) != ("state", ph[start]):
                raise InvariantError(f"{req_id}: its Mamba layers start from block {prev}, which does not hold the "
                                     f"state after its first {start} tokens")
        running = blocks[-(-end // bs) - 1]
        if running == NULL_BLOCK:
            raise InvariantError(f"{req_id}: its Mamba state after {end} tokens goes to the null block")
        self.shadow[running] = ("state", ph[end])
        self.state_block[req_id] = running

    def _job_start(self, job) -> int:
        keys = self._keys(job.req_id, job.group)
        return keys.index(job.keys[0]) * self.chunk_tokens + job.first_block * self.block_size

    def _check_load_targets(self, job) -> int:
        """Alignment, and no load into a block holding computed tokens (shared or cached)."""
        cb, bs = self.chunk_blocks, self.block_size
        if not 0 <= job.first_block < cb or not job.block_ids:
            raise InvariantError(f"{job.req_id}: load starts at block {job.first_block} of a {cb}-block chunk")
        if len(job.keys) != -(-(job.first_block + len(job.block_ids)) // cb):
            raise InvariantError(f"{job.req_id}: {len(job.keys)} chunks for {len(job.block_ids)} blocks "
                                 f"from block {job.first_block}")
        keys = self._keys(job.req_id, job.group)
        k0 = keys.index(job.keys[0])
        if tuple(keys[k0 : k0 + len(job.keys)]) != job.keys:
            raise InvariantError(f"{job.req_id}: load keys are not consecutive chunks of its prompt")
        start = self._job_start(job)
        if job.group and self.mamba:  # one block, the state at the chunk's end, into the block vLLM gave there
            if (len(job.keys), job.first_block, len(job.block_ids)) != (1, 0, 1):
                raise InvariantError(f"{job.req_id}: a Mamba state load of {len(job.keys)} chunks, {len(job.block_ids)} "
                                     f"blocks from block {job.first_block}")
            start += (cb - 1) * bs
        blocks = self._blocks(job.req_id, job.group)  # (that the window's loads cover what it reads: _check_computed)
        for i, block_id in enumerate(job.block_ids):
            if blocks[start // bs + i] != block_id:
                raise InvariantError(f"{job.req_id}: load targets block {block_id} at #{start // bs + i}, "
                                     f"which holds block {blocks[start // bs + i]}")
            block = self.pool.blocks[block_id]
            if block.ref_cnt != 1 or block.block_hash is not None:
                raise InvariantError(f"{job.req_id}: load targets block {block_id} that holds computed tokens "
                                     f"(ref_cnt {block.ref_cnt}, cached {block.block_hash is not None})")
        parked = getattr(self.sched, "_parked", ())
        if job.group:
            kind = "state" if self.mamba else "window"
            self.stats.loads[f"{kind}_handoff" if job.req_id in parked else kind] += 1
            return start
        kind = "handoff" if job.req_id in parked else ("partial" if job.first_block else "load")
        self.stats.loads[kind] += 1
        return start

    def _save(self, save) -> None:
        """Saved blocks must hold exactly the chunk's tokens; the store keeps what was saved."""
        keys, cb, bs = self._keys(save.req_id, save.group), self.chunk_blocks, self.block_size
        ph = self._ph(save.req_id)
        state = bool(save.group and self.mamba)  # Mamba: one block, the state at the chunk's end
        cb = 1 if state else cb
        for i, key in enumerate(save.keys):
            k = keys.index(key)
            contents = []
            for b in range(cb):
                block_id, pos = save.block_ids[i * cb + b], (k * cb + b) * bs
                held = self.shadow.get(block_id, ())
                want = ("state", ph[(k + 1) * self.chunk_tokens]) if state else tuple(ph[pos + 1 : pos + bs + 1])
                if held[:bs] != want:
                    raise InvariantError(f"{save.req_id}: group {save.group} saves chunk {k} from block {block_id} "
                                         f"which does not hold {'the state after' if state else 'the KV of'} tokens "
                                         f"[{0 if state else pos}, {(k + 1) * self.chunk_tokens if state else pos + bs})")
                contents.append(held[:bs])
            if key not in self.index.chunks:
                if len(self.index.chunks) >= self.store_chunks:  # LRU-ish: oldest first
                    self.index.remove(next(iter(self.index.chunks)))
                self.index.put(key, self.rng.choice(("cpu", "cpu", "disk")), tuple(contents))

    def _run_loads(self) -> tuple[set[str], set[int], set[str]]:
        """Run the loads due now: requests whose loads all ran, failed block ids (one group), and
        requests of which a load failed (a hybrid model: its block ids name no group)."""
        finished, invalid, failed_requests = set(), set(), set()
        waiting = []
        for p in self.pending:
            if p.lag > 0:
                p.lag -= 1
                waiting.append(p)
                continue
            job, cb, bs = p.job, self.chunk_blocks, self.block_size
            request = self.requests[job.req_id]
            if job.req_id not in self.sched.requests:
                raise InvariantError(f"{job.req_id}: its blocks were freed while its load was still running")
            blocks = self._blocks(job.req_id, job.group)
            done = 0
            for i, key in enumerate(job.keys):
                hit = self.index.chunks.get(key)
                if job.remote is not None and i >= job.remote.first_chunk:
                    hit = self._produced(job.req_id, key, job.group)  # the producer computed the whole prompt
                    self.stats.loads["remote_chunks"] += 1
                if hit is None or i == p.fail_at or key in self.fail_next:
                    if hit is None:
                        self.stats.evicted_before_load += 1
                    elif not self.stale:  # the real worker drops a chunk that fails verification
                        self.index.remove(key)
                    self.fail_next.discard(key)
                    break
                first = job.first_block if i == 0 else 0
                count = min(cb - first, len(job.block_ids) - done)
                for b in range(count):
                    block_id = job.block_ids[done + b]
                    if blocks[p.start // bs + done + b] != block_id:
                        raise InvariantError(f"{job.req_id}: block {block_id} changed owner before its load ran (group "
                                             f"{job.group}, job from token {p.start}, blocks now {blocks})")
                    self.shadow[block_id] = hit[1][first + b]
                done += count
            failed = done < len(job.block_ids)
            self.stats.failed_loads += failed
            # A remote load ends with the prompt's last, partial block: what counts is the prompt.
            resume = min(p.start + done * bs, request.num_prompt_tokens)
            if self.num_groups == 1:
                if failed:
                    invalid.update(job.block_ids[done:])
                finished.add(job.req_id)
                if not request.is_finished():
                    self.expect_resume[job.req_id] = resume
                continue
            part = self.parts[job.req_id]  # the request is reported once all its groups' loads ran
            part[0] -= 1
            part[1] |= failed
            if job.group == 0:
                part[2] = resume
            if part[0] == 0:
                del self.parts[job.req_id]
                finished.add(job.req_id)
                if part[1]:
                    failed_requests.add(job.req_id)  # the engine drops its tokens and admits it afresh
                elif not request.is_finished():
                    self.expect_resume[job.req_id] = part[2]
        self.pending = waiting
        return finished, invalid, failed_requests

    def _produced(self, req_id: str, key: bytes, group: int = 0) -> tuple:
        """What a P/D producer sends for chunk ``key`` of ``req_id`` (of KV cache ``group``):
        (tier, per-block contents), the last block of a partial tail holding only the prompt's tokens."""
        k, bs, cb = self._keys(req_id, group).index(key), self.block_size, self.chunk_blocks
        ph, end = self._ph(req_id), self.requests[req_id].num_prompt_tokens
        if group and self.mamba:  # the state at the chunk's end
            return "remote", (("state", ph[(k + 1) * self.chunk_tokens]),)
        blocks = [tuple(ph[p + 1] for p in range(pos, min(pos + bs, end)))
                  for pos in range(k * cb * bs, min((k + 1) * cb * bs, end), bs)]
        return "remote", tuple(blocks)

    def _runner_output(self, out, finished: set[str], invalid: set[int], failed: set[str] = frozenset()) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        sampled = []
        for req_id in req_ids:
            request = self.requests[req_id]
            if starts[req_id] + out.num_scheduled_tokens[req_id] >= request.num_tokens:
                sampled.append([3 + self._ph(req_id)[-1] % (VOCAB - 3)])
            else:
                sampled.append([])  # a prefill chunk that does not reach the end samples nothing
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=_connector_output(finished, invalid, failed),
        )

    def close(self) -> None:
        self.sched.shutdown()


def _connector_output(finished: set[str], invalid: set[int], failed: set[str]) -> KVConnectorOutput:
    """What the workers report, as the installed vLLM carries it: loads that failed as a whole in
    ``failed_recving`` where it has it (the connector's get_transfer_results), else in the stats."""
    if KVConnectorTransferResults is not None:
        return KVConnectorOutput(finished_recving=finished or None, invalid_block_ids=invalid, failed_recving=set(failed))
    return KVConnectorOutput(finished_recving=finished or None, invalid_block_ids=invalid,
                             kv_connector_stats=KvtierStats(data={FAILED_REQUESTS: sorted(failed)}) if failed else None)
