"""The check of a transfer's chunks that landed in the engine's blocks (:mod:`kvtier.transfer.landed`),
built ahead on a thread of its own while the chunks are on their way: it finds what a check built
then finds, a corrupt chunk included, for all the chunks (a pull) or a run of them (a push's
step), and is not used for chunks it was not built for. Needs a CUDA device: only the GPU
kernel's plan is built ahead."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier.jobs import Landed, LoadJob, RemoteSource
from kvtier.layout import build_layout
from kvtier.ops.checksum import as_unsigned
from kvtier.transfer.landed import BlockSums, LandedCheck

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCK, CHUNK_BLOCKS, CHUNKS = 16, 4, 24
LAYERS, HEADS, HEAD_DIM = 4, 8, 128


@pytest.fixture
def landed():
    """A layout whose blocks are random, a pull of CHUNKS chunks landed in shuffled blocks, and the
    KVSUM64 of each (what the producer would send), taken by a check built then."""
    num_blocks = 2 * CHUNKS * CHUNK_BLOCKS
    kv = {f"l{i}": torch.randn(num_blocks, 2, BLOCK, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
          for i in range(LAYERS)}
    layout = build_layout(kv, BLOCK, num_blocks)
    ids = tuple(torch.randperm(num_blocks)[: CHUNKS * CHUNK_BLOCKS].tolist())
    chunks = [ids[c * CHUNK_BLOCKS : (c + 1) * CHUNK_BLOCKS] for c in range(CHUNKS)]
    sums = as_unsigned(BlockSums(layout, CHUNK_BLOCKS).launch(
        [(torch.tensor(c, device="cuda"), CHUNK_BLOCKS) for c in chunks]).cpu())
    job = LoadJob("r", tuple(bytes([c]) * 16 for c in range(CHUNKS)), 0, ids, remote=RemoteSource("t", ("tcp://p",), 0))
    rows = [(c, c * CHUNK_BLOCKS, CHUNK_BLOCKS, Landed(sums[c], 1)) for c in range(CHUNKS)]
    return kv, layout, job, chunks, rows


def ids_of(block_ids) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.int64, device="cuda")


def test_a_check_built_ahead_finds_what_one_built_then_does(landed, caplog):
    kv, layout, job, chunks, rows = landed
    check = LandedCheck(layout, CHUNK_BLOCKS)
    with caplog.at_level(logging.DEBUG, logger="kvtier.transfer.landed"):
        ahead = check.prepare([None, *chunks[1:]])  # the first chunk came from this engine's own tier
        everything = len(job.block_ids)
        assert check.loaded(job, rows[1:], everything, CHUNKS, ids_of, ahead) == (everything, CHUNKS, CHUNKS - 1)
        assert "plan built ahead" in caplog.text
        kv["l2"][chunks[7][1]] += 1  # a corrupt block in chunk 7: everything from it on is recomputed
        ahead = check.prepare([None, *chunks[1:]])
        assert check.loaded(job, rows[1:], len(job.block_ids), CHUNKS, ids_of, ahead) == (7 * CHUNK_BLOCKS, 7, 6)
        assert "chunk 7 of transfer t" in caplog.text


def test_a_run_of_the_chunks_is_checked_by_the_plan_built_for_them_all(landed, caplog):
    """A push's step: chunks 8 to 15 landed; chunk 10 is corrupt, the last one too (not landed yet)."""
    kv, layout, job, chunks, rows = landed
    check = LandedCheck(layout, CHUNK_BLOCKS)
    kv["l0"][chunks[CHUNKS - 1][0]] += 1
    kv["l3"][chunks[10][2]] -= 1
    with caplog.at_level(logging.DEBUG, logger="kvtier.transfer.landed"):
        ahead = check.prepare(chunks)
        assert check.loaded(job, rows[8:16], 16 * CHUNK_BLOCKS, 16, ids_of, ahead) == (10 * CHUNK_BLOCKS, 10, 2)
        assert "8 chunks landed, checked in" in caplog.text and "plan built ahead" in caplog.text
        assert "chunk 10 of transfer t" in caplog.text


def test_a_check_built_ahead_for_other_chunks_is_not_used(landed, caplog):
    kv, layout, job, chunks, rows = landed
    check = LandedCheck(layout, CHUNK_BLOCKS)
    kv["l0"][chunks[CHUNKS - 1][0]] += 1  # the last chunk is corrupt, but only the first half landed
    with caplog.at_level(logging.DEBUG, logger="kvtier.transfer.landed"):
        ahead = check.prepare([None, *chunks[1:]])  # chunk 0 was to come from this engine's own tier
        half = CHUNKS // 2 * CHUNK_BLOCKS
        assert check.loaded(job, rows[: CHUNKS // 2], half, CHUNKS // 2, ids_of, ahead) == (half, 12, 12)
        assert "plan built then" in caplog.text and "plan built ahead" not in caplog.text
