"""P/D of a hybrid model between two real worker halves: every served KV cache group's chunks travel.

A full-attention layer and a sliding-window layer (two KV cache groups over one block pool), as
vLLM's hybrid KV cache manager lays them out; real stores, real ZMQ. P publishes both groups'
chunks and tails; D loads the full group's every block and the window group's window only. With
Mamba state, the state at the last chunk end before the prompt's last token.
"""

from __future__ import annotations

import time

import torch

from kvtier.config import KvtierConfig
from kvtier.engines.vllm.stats import FAILED_REQUESTS
from kvtier.engines.vllm.worker_side import WorkerSide
from kvtier.jobs import LoadJob, RemoteSource, SaveJob
from kvtier.keys import group_key

from pd_workers import BLOCK, CHUNK, MODEL, NUM_BLOCKS, prompt_keys, tokens_of

GROUPS = (("full_attention", 0, ("layer.0",)), ("sliding_window", 2 * BLOCK, ("layer.1",)))


def engine(tmp_path, name: str, seed: int, groups=GROUPS, block: int = BLOCK) -> tuple[WorkerSide, dict]:
    generator = torch.Generator().manual_seed(seed)
    kv = {f"layer.{i}": torch.randn(NUM_BLOCKS, 2, block, 32, generator=generator) for i in range(2)}
    config = KvtierConfig.from_dict({"chunk_tokens": CHUNK, "cpu_bytes": 16 << 20, "pd_timeout_ms": 1000})
    side = WorkerSide(config, MODEL, block, NUM_BLOCKS, f"ipc://{tmp_path}/{name}.sock", 0, 1, groups=groups)
    side.register(kv)
    return side, kv


def loaded(side: WorkerSide, req_id: str, timeout_s: float = 20.0) -> dict:
    """The stats once ``req_id``'s loads (every group's) reported."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if req_id in side.finished_loads():
            return side.take_stats() or {}
        time.sleep(0.005)
    raise AssertionError(f"load of {req_id} never reported")


def test_a_hybrid_consumer_loads_every_group_from_the_producer(tmp_path):
    tokens = tokens_of(3 * CHUNK + 20, seed=5)  # three chunks and a 2-block tail
    keys, tail = prompt_keys(tokens)
    every = keys + [tail]
    p, p_kv = engine(tmp_path, "p", seed=1)
    d, d_kv = engine(tmp_path, "d", seed=2)
    try:
        n = -(-len(tokens) // BLOCK)  # 8 blocks
        p_blocks, p_window = list(range(1, 1 + n)), list(range(20, 20 + n))
        p.save((SaveJob("p-req", tuple(group_key(k, 1) for k in every), tuple(p_window), publish="t/1", group=1,
                        final=True),
                SaveJob("p-req", tuple(every), tuple(p_blocks), publish="t", final=True)))
        source = RemoteSource("t", (f"tcp://127.0.0.1:{p.chunk_server.port}",), 0)
        window_source = RemoteSource("t/1", source.endpoints, 0)  # each group's chunks: a transfer of their own
        # D loads through the last full block before the last token (7 blocks); the window of
        # 32 tokens at 112 reads blocks 5 and 6: chunk 2's second and the tail's first
        d_blocks, d_window = list(range(40, 47)), [56, 57]
        d.start_loads((LoadJob("d-req", tuple(every), 0, tuple(d_blocks), 2, source),
                       LoadJob("d-req", (group_key(keys[2], 1), group_key(tail, 1)), 1, tuple(d_window), 2,
                               window_source, group=1)))
        stats = loaded(d, "d-req")
        assert FAILED_REQUESTS not in stats and d.failed_blocks() == set()
        assert torch.equal(d_kv["layer.0"][d_blocks], p_kv["layer.0"][p_blocks[:7]])
        assert torch.equal(d_kv["layer.1"][d_window], p_kv["layer.1"][p_window[5:7]])
        # negative control: chunks P never published fail the request, every group's
        o_keys, o_tail = prompt_keys(tokens_of(2 * CHUNK + 20, seed=6))
        d.start_loads((LoadJob("e-req", tuple(o_keys + [o_tail]), 0, tuple(range(40, 45)), 2, source),
                       LoadJob("e-req", (group_key(o_keys[1], 1), group_key(o_tail, 1)), 1, (56, 57), 2,
                               window_source, group=1)))
        assert loaded(d, "e-req").get(FAILED_REQUESTS) == ["e-req"]
    finally:
        p.close()
        d.close()


def test_a_mamba_hybrids_consumer_loads_the_state_at_its_last_chunk_end(tmp_path):
    """Full attention + Mamba state in align mode (one block per chunk, the state at its end):
    P publishes the states where its steps ended (chunks 1 and 2); D loads through chunk 2's
    end, the last before the prompt's last token, and that one state lands in its block."""
    groups = (GROUPS[0], ("mamba", 0, ("layer.1",)))
    tokens = tokens_of(3 * CHUNK + 20, seed=7)
    keys, tail = prompt_keys(tokens)
    p, p_kv = engine(tmp_path, "p", seed=3, groups=groups)
    d, d_kv = engine(tmp_path, "d", seed=4, groups=groups)
    try:
        assert p.chunk_server is not None
        n = -(-len(tokens) // BLOCK)
        p_blocks, states = list(range(1, 1 + n)), {1: 30, 2: 31}  # chunk -> P's state block
        p.save((SaveJob("p-req", (group_key(keys[1], 1), group_key(keys[2], 1)), (30, 31), publish="t/1", group=1,
                        final=True),
                SaveJob("p-req", tuple(keys + [tail]), tuple(p_blocks), publish="t", final=True)))
        source = RemoteSource("t", (f"tcp://127.0.0.1:{p.chunk_server.port}",), 0)
        d_blocks = list(range(40, 40 + 3 * CHUNK // BLOCK))
        d.start_loads((LoadJob("d-req", tuple(keys), 0, tuple(d_blocks), 0, source),
                       LoadJob("d-req", (group_key(keys[2], 1),), 0, (60,), 0, RemoteSource("t/1", source.endpoints, 0),
                               group=1)))
        stats = loaded(d, "d-req")
        assert FAILED_REQUESTS not in stats and d.failed_blocks() == set()
        assert torch.equal(d_kv["layer.0"][d_blocks], p_kv["layer.0"][p_blocks[: len(d_blocks)]])
        assert torch.equal(d_kv["layer.1"][60], p_kv["layer.1"][states[2]])
        # negative control: a state P never published (chunk 0's: no step ended there) fails the request
        d.start_loads((LoadJob("e-req", keys[:1], 0, tuple(d_blocks[: CHUNK // BLOCK]), 0, source),
                       LoadJob("e-req", (group_key(keys[0], 1),), 0, (61,), 0, RemoteSource("t/1", source.endpoints, 0),
                               group=1)))
        assert loaded(d, "e-req").get(FAILED_REQUESTS) == ["e-req"]
    finally:
        p.close()
        d.close()


def test_hybrid_engines_of_different_block_sizes_never_pair(tmp_path):
    """A hybrid's chunks are never re-cut to another block size: its fingerprint covers it."""
    from kvtier.engines.vllm.groups import group_layouts

    kv = {f"layer.{i}": torch.zeros(NUM_BLOCKS, BLOCK, 2, 32) for i in range(2)}  # tokens outermost in a block
    half = {f"layer.{i}": torch.zeros(NUM_BLOCKS, BLOCK // 2, 2, 32) for i in range(2)}
    one = group_layouts(kv, GROUPS, BLOCK, NUM_BLOCKS, model=MODEL)[0]
    other = group_layouts(half, GROUPS, BLOCK // 2, NUM_BLOCKS, model=MODEL)[0]
    assert one.token_contiguous and other.token_contiguous  # per-token layouts: only the block size differs
    assert one.fingerprint != other.fingerprint
