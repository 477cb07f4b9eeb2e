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
        if not (0 <= self.first and self.first + self.block_ids.numel() <= self.num_blocks):
            raise ValueError(
                f"span of {self.block_ids.numel()} blocks from {self.first} exceeds a chunk of {self.num_blocks} blocks."
            )
