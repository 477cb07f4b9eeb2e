"""P/D between engines of different block sizes: with a token-contiguous layout (flash attention's
NHD) D gets P's KV token for token, its partial tail re-cut to D's blocks, and keeps the full
chunks in a form its own reloads verify; with any other layout the handshake refuses."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier import codec
from kvtier.jobs import LoadJob
from pd_workers import CHUNK, Engine, prompt_keys, publish, remote_job, tokens_of

PROMPT = tokens_of(100)  # three full chunks of 32 tokens and a 4-token tail


def blocks_for(block: int, first: int) -> list[int]:
    return list(range(first, first + -(-len(PROMPT) // block)))


def token_kv(engine: Engine, block_ids: list[int], tokens: int) -> torch.Tensor:
    """The KV of the first ``tokens`` tokens held in ``block_ids``, in token order:
    ``[layers, 2, tokens, heads, head]`` (the engine's kv is ``[layers, 2, blocks, block, heads, head]``)."""
    kv = engine.kv[:, :, block_ids]
    return kv.flatten(2, 3)[:, :, :tokens].clone()


@pytest.mark.parametrize("wait", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("p_block, d_block", [(16, 32), (32, 16)])
def test_nhd_consumer_of_another_block_size_gets_every_token_and_reloads_what_it_kept(
        engines, transport, p_block, d_block, wait):
    p = engines("p", 1, block=p_block, nhd=True)
    d = engines("d", 2, block=d_block, nhd=True)
    assert p.side.transfers.layout.fingerprint == d.side.transfers.layout.fingerprint
    p_blocks, d_blocks = blocks_for(p_block, 10), blocks_for(d_block, 40)
    keys = publish(p, PROMPT, p_blocks, "t1")
    d.side.start_loads((remote_job("d-req", PROMPT, d_blocks, "t1", p.endpoint, wait=wait, block=d_block),))
    assert d.wait_loaded("d-req") == set()
    want = token_kv(p, p_blocks, len(PROMPT))
    assert torch.equal(token_kv(d, d_blocks, len(PROMPT)), want)  # the tail too, re-cut by P
    assert d.side.transfers.stats.remote_hit_tokens == len(d_blocks) * d_block

    # D kept the full chunks in its own CPU tier: each verifies under D's layout, and reloads
    full = CHUNK * 3
    d_layout, chunk_blocks = d.side.transfers.layout, CHUNK // d_block
    for key in keys[:3]:
        buffer = d.side.store.get(d.side.transfers.skey(key))
        try:
            assert codec.verify_chunk(buffer.data, d_layout, chunk_blocks).tokens == CHUNK
        finally:
            buffer.release()
    again = list(range(0, full // d_block))
    d.side.start_loads((LoadJob("again", tuple(keys[:3]), 0, tuple(again)),))
    assert d.wait_loaded("again") == set()
    assert torch.equal(token_kv(d, again, full), want[:, :, :full])


def test_hnd_layouts_of_different_block_sizes_are_refused_at_the_handshake(engines, caplog):
    p = engines("p", 1, block=16)  # vLLM-CPU's [num_blocks, heads, block, 2*head]: heads outside tokens
    d = engines("d", 2, block=32)
    p_blocks, d_blocks = blocks_for(16, 10), blocks_for(32, 40)
    publish(p, PROMPT, p_blocks, "t1")
    before = d.kv.clone()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        d.side.start_loads((remote_job("d-req", PROMPT, d_blocks, "t1", p.endpoint, block=32),))
        assert d.wait_loaded("d-req") == set(d_blocks)  # all recomputed
    assert torch.equal(d.kv, before)  # nothing scattered
    line = next(r.getMessage() for r in caplog.records if "layouts differ" in r.getMessage())
    assert "block sizes may differ only where both layouts are token-contiguous" in line
    assert "block size 16 (not token-contiguous" in line and "block size 32 (not token-contiguous" in line
    full, _ = prompt_keys(PROMPT)
    assert all(d.side.store.contains(d.side.transfers.skey(k)) is None for k in full)
