"""Load and save jobs: what the scheduler side asks a worker to move (they cross process boundaries)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Load ``len(block_ids)`` blocks of a request from consecutive stored chunks.

    ``keys``: chain keys of the chunks, in prompt order. ``first_block``: the block of the first
    chunk where loading starts (non-zero when the engine already holds the start of that chunk).
    ``block_ids``: engine blocks to fill, in order.
    """

    req_id: str
    keys: tuple[bytes, ...]
    first_block: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SaveJob:
    """Save full chunks: ``block_ids`` holds ``len(keys) * chunk_blocks`` engine blocks in order."""

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
