"""P/D between engines of different TP sizes, through the real worker halves (each rank its own
worker half, store and chunk server, in one process): a decode rank gathers its KV heads from the
producer ranks that hold them (:mod:`kvtier.pd.consumer.gather`), byte for byte.

KV memory as vLLM-CPU lays it out, ``[NUM_BLOCKS, heads, BLOCK, 2*head]`` per layer: an engine of
two KV heads holds both at TP=1 and one per rank at TP=2 (rank r: head r)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from kvtier.config import KvtierConfig
from kvtier.engines.vllm.worker_side import WorkerSide
from pd_workers import BLOCK, CHUNK, MODEL, NUM_BLOCKS, Engine, prompt_keys, publish, remote_job, tokens_of, wait_for
from kvtier.jobs import LoadJob
from kvtier.keys import storage_key
from kvtier.transfer.pieces import piece_keys

PROMPT = tokens_of(100)  # three full chunks and a 4-token tail: 7 blocks
P_BLOCKS = list(range(10, 17))
D_BLOCKS = list(range(40, 47))
HEADS = 2
LAYERS = 2


@pytest.fixture
def ranks(tmp_path, transport):
    """``make(name, tp)``: an engine's ranks, each a worker half over its heads of one full KV
    (``[LAYERS, NUM_BLOCKS, HEADS, BLOCK, 32]``, returned too; ``nhd``: flash attention's
    ``[LAYERS, 2, NUM_BLOCKS, block, HEADS, 16]``, token-contiguous, any ``block`` size)."""
    made: list[Engine] = []

    def make(name: str, tp: int, seed: int, block: int = BLOCK, nhd: bool = False,
             **config) -> tuple[list[Engine], torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        if nhd:
            full = torch.randn(LAYERS, 2, NUM_BLOCKS, block, HEADS, 16, generator=generator).to(torch.bfloat16)
        else:
            full = torch.randn(LAYERS, NUM_BLOCKS, HEADS, block, 32, generator=generator)
        cfg = KvtierConfig.from_dict({"chunk_tokens": CHUNK, "cpu_bytes": 16 << 20, "pd_timeout_ms": 2000,
                                      "pd_transport": transport, **config})
        engines = []
        per = HEADS // tp
        for rank in range(tp):
            kv = full.narrow(4 if nhd else 2, rank * per, per).contiguous()
            side = WorkerSide(cfg, MODEL, block, NUM_BLOCKS, f"ipc://{tmp_path}/{name}.sock", rank, tp,
                              heads=(per, HEADS))
            side.register({f"layer.{i}": kv[i] for i in range(LAYERS)})
            if transport == "nixl":
                assert side.nixl_ready(), "NIXL did not start"
            engines.append(Engine(side, kv))
            made.append(engines[-1])
        return engines, full

    yield make
    for engine in made:
        engine.side.close()


def whole(ranks: list[Engine], blocks: list[int]) -> torch.Tensor:
    """The engine's blocks ``blocks``, its ranks' heads side by side: ``[LAYERS, n, HEADS, BLOCK, 32]``."""
    return torch.cat([r.blocks(blocks) for r in ranks], dim=2)


def job_from(endpoints: tuple[str, ...], transfer_id: str = "t1", wait: bool = False, blocks: list[int] = D_BLOCKS,
             block: int = BLOCK):
    """D's load of the whole prompt into ``blocks`` (of ``block`` tokens) from a producer whose ranks'
    chunk servers are ``endpoints`` (``wait``: a push, D asks before P computed anything)."""
    job = remote_job("d-req", PROMPT, blocks, transfer_id, endpoints[0], wait=wait, block=block)
    return dataclasses.replace(job, remote=dataclasses.replace(job.remote, endpoints=endpoints))


def load(d: list[Engine], endpoints: tuple[str, ...]) -> None:
    for rank in d:
        rank.side.start_loads((job_from(endpoints),))
    for rank in d:
        assert rank.wait_loaded("d-req") == set()


def test_tp2_producer_to_tp1_consumer_gathers_both_heads(ranks):
    (p0, p1), _ = ranks("p", 2, 1)
    (d,), _ = ranks("d", 1, 2)
    for p in (p0, p1):
        publish(p, PROMPT, P_BLOCKS, "t1")
    load([d], (p0.endpoint, p1.endpoint))
    assert torch.equal(d.blocks(D_BLOCKS), whole([p0, p1], P_BLOCKS))
    wait_for(lambda: p0.side.holds.stats.released == 1 and p1.side.holds.stats.released == 1)
    keys, _ = prompt_keys(PROMPT)  # scattered straight from P's pieces, kept as those pieces (nothing joined)
    layout = d.side.transfers.layout
    assert all(d.side.store.contains(k) is not None for key in keys
               for k in piece_keys(layout, key, ((0, 1), (1, 2))))
    assert all(d.side.store.contains(storage_key(key, layout.fingerprint)) is None for key in keys)
    again = list(range(50, 50 + 3 * CHUNK // BLOCK))  # a later request of the prompt: a local hit of those pieces
    d.side.start_loads((LoadJob("again", tuple(keys), 0, tuple(again)),))
    assert d.wait_loaded("again") == set()
    assert torch.equal(d.blocks(again), whole([p0, p1], P_BLOCKS[: len(again)]))


def test_tp1_producer_to_tp2_consumer_each_rank_takes_its_head(ranks):
    (p,), _ = ranks("p", 1, 1)
    (d0, d1), _ = ranks("d", 2, 2)
    publish(p, PROMPT, P_BLOCKS, "t1")
    load([d0], (p.endpoint,))
    assert p.side.holds.stats.released == 0 and p.side.holds.pinned_bytes() > 0  # rank 1 still reads them
    load([d1], (p.endpoint,))
    assert torch.equal(whole([d0, d1], D_BLOCKS), p.blocks(P_BLOCKS))
    wait_for(lambda: p.side.holds.stats.released == 1)
    assert p.side.holds.pinned_bytes() == 0
    assert p.side.chunk_server.cut_total == 2 * 4  # P cut each rank's head out of its 4 chunks: half the bytes sent
    keys, _ = prompt_keys(PROMPT)  # each rank loads and keeps its part as its own chunk
    for d in (d0, d1):
        assert all(d.side.store.contains(storage_key(key, d.side.transfers.layout.fingerprint)) for key in keys)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_with_a_secret_each_connection_passes_its_own_handshake_and_another_secret_none(ranks, p_tp, d_tp):
    """CURVE and every message's MAC at other TP sizes: each D rank's connection to each P rank it
    reads makes its own handshake (its own nonce). D's ranks of another secret get nothing: every
    block recomputed, the P rank they reach first turning them away at the CURVE handshake (a D rank
    that gathers gives up at its first piece, so it never reaches the second)."""
    p, _ = ranks("p", p_tp, 1, pd_secret="one secret")
    d, _ = ranks("d", d_tp, 2, pd_secret="one secret")
    for rank in p:
        publish(rank, PROMPT, P_BLOCKS, "t1")
    load(d, tuple(rank.endpoint for rank in p))
    assert torch.equal(whole(d, D_BLOCKS), whole(p, P_BLOCKS))
    other, _ = ranks("o", d_tp, 3, pd_secret="another secret", pd_timeout_ms=500)
    for rank in p:
        publish(rank, PROMPT, P_BLOCKS, "t2")
    for rank in other:
        rank.side.start_loads((job_from(tuple(r.endpoint for r in p), transfer_id="t2"),))
    for rank in other:
        assert rank.wait_loaded("d-req") == set(D_BLOCKS)  # nothing came: all recomputed
    assert sum(rank.side.chunk_server.served_total for rank in p) == 4 * max(p_tp, d_tp)  # only t1's chunks
    wait_for(lambda: sum(rank.side.chunk_server.rejected for rank in p) > 0)  # turned away at the handshake


def test_a_corrupt_stored_chunk_is_never_cut_for_a_larger_tp_size(ranks, caplog):
    """P checks its stored chunk as it cuts a decode rank's heads out of it: a flipped byte in the
    head the rank does not take still fails it (removed, answered missing, recomputed from there)."""
    (p,), _ = ranks("p", 1, 1)
    (d0, d1), _ = ranks("d", 2, 2)
    keys = publish(p, PROMPT, P_BLOCKS, "t1")
    p.side.transfers.drain()
    skey = p.side.transfers.skey(keys[1])
    buffer = p.side.store.get(skey)
    buffer.data[-1] ^= 0xFF  # the last byte: head 1's, which rank 0 does not take
    buffer.release()
    d0.side.start_loads((job_from((p.endpoint,)),))
    assert d0.wait_loaded("d-req") == set(D_BLOCKS[CHUNK // BLOCK :])  # chunk 0 loaded; from chunk 1 on, recomputed
    assert "unusable" in caplog.text and skey.hex() in caplog.text
    assert p.side.store.contains(skey) is None


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_push_consumers_wait_for_every_producer_rank(ranks, p_tp, d_tp):
    p, _ = ranks("p", p_tp, 1)
    d, _ = ranks("d", d_tp, 2)
    endpoints = tuple(rank.endpoint for rank in p)
    for rank in d:  # D's ranks ask first: P's ranks park their fetches until the chunks are sealed
        rank.side.start_loads((job_from(endpoints, wait=True),))
    time.sleep(0.3)
    for rank in p:
        publish(rank, PROMPT, P_BLOCKS, "t1")
    for rank in d:
        assert rank.wait_loaded("d-req") == set()
    assert torch.equal(whole(d, D_BLOCKS), whole(p, P_BLOCKS))


def test_a_corrupt_piece_fails_the_load_from_that_chunk(ranks, caplog):
    (p0, p1), _ = ranks("p", 2, 1)
    (d,), _ = ranks("d", 1, 2)
    keys = [publish(p, PROMPT, P_BLOCKS, "t1") for p in (p0, p1)][1]
    p1.side.transfers.drain()
    buffer = p1.side.store.get(p1.side.transfers.skey(keys[1]))
    buffer.data[-1] ^= 0xFF  # one flipped byte in rank 1's piece of chunk 1
    buffer.release()
    d.side.start_loads((job_from((p0.endpoint, p1.endpoint)),))
    failed = d.wait_loaded("d-req")
    assert failed == set(D_BLOCKS[CHUNK // BLOCK :])  # chunk 0 loaded; from chunk 1 on, recomputed
    assert "KV heads 1-2" in caplog.text and "checksum" in caplog.text


def token_kv(ranks: list[Engine], block_ids: list[int]) -> torch.Tensor:
    """The prompt's KV in ``block_ids`` of an NHD engine's ranks, token by token, their heads side by
    side: ``[LAYERS, 2, len(PROMPT), HEADS, 16]``."""
    return torch.cat([r.kv[:, :, block_ids].flatten(2, 3)[:, :, : len(PROMPT)] for r in ranks], dim=3)


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1)], ids=["tp1-to-tp2", "tp2-to-tp1"])
@pytest.mark.parametrize("p_block, d_block", [(16, 32), (32, 16)])
def test_nhd_across_tp_and_block_sizes_every_token_arrives(ranks, p_tp, d_tp, p_block, d_block):
    """Token-contiguous layouts: P's cut or D's pieces, the partial tail re-cut to D's blocks by P."""
    p, _ = ranks("p", p_tp, 1, block=p_block, nhd=True)
    d, _ = ranks("d", d_tp, 2, block=d_block, nhd=True)
    p_blocks = list(range(10, 10 + -(-len(PROMPT) // p_block)))
    d_blocks = list(range(40, 40 + -(-len(PROMPT) // d_block)))
    for rank in p:
        publish(rank, PROMPT, p_blocks, "t1")
    for rank in d:
        rank.side.start_loads((job_from(tuple(r.endpoint for r in p), blocks=d_blocks, block=d_block),))
    for rank in d:
        assert rank.wait_loaded("d-req") == set()
    assert torch.equal(token_kv(d, d_blocks), token_kv(p, p_blocks))
    assert sum(rank.side.chunk_server.cut_total for rank in p) == (2 * 4 if p_tp < d_tp else 0)  # 4 chunks a D rank
