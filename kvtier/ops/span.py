"""The unit of work of every copy op: some blocks of one chunk, and where they go in the engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """Blocks ``first .. first + len(block_ids) - 1`` of a chunk of ``num_blocks`` blocks.

    ``buffer``: the whole chunk, ``uint8 [codec.chunk_bytes(layout, num_blocks)]`` (header
    included; ops touch only the payload), host or device memory. ``block_ids``: ``int64 [k]``
    engine block ids on the layout's device; block ``first + i`` of the chunk maps to
    ``block_ids[i]``. The caller owns ``buffer`` and keeps it alive until the op returns.
    """

    buffer: torch.Tensor
    num_blocks: int
    first: int
    block_ids: torch.Tensor

    def __post_init__(self) -> None:
        _within(self.first, self.block_ids.numel(), self.num_blocks)


@dataclass(frozen=True, slots=True)
class PieceSpan:
    """Blocks ``first .. first + len(block_ids) - 1`` of a chunk held as pieces other TP sizes' ranks
    stored (:mod:`kvtier.shards`), scattered from them straight into the engine's head slices.

    ``pieces``: (the KV heads a piece holds, its whole buffer: header and payload, host memory),
    in head order, together holding the engine's heads; each piece is checked against its own
    KVSUM64 as it is copied (every byte of it summed, those of heads the engine does not hold
    too). Only the ``cpu`` ops backend takes these.
    """

    pieces: tuple[tuple[tuple[int, int], torch.Tensor], ...]
    num_blocks: int
    first: int
    block_ids: torch.Tensor

    def __post_init__(self) -> None:
        _within(self.first, self.block_ids.numel(), self.num_blocks)


def _within(first: int, count: int, num_blocks: int) -> None:
    if not (0 <= first and first + count <= num_blocks):
        raise ValueError(f"span of {count} blocks from {first} exceeds a chunk of {num_blocks} blocks.")
