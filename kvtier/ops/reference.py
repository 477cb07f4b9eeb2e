"""One ``copy_`` per block and region: the naive path, and the oracle the fast backends are tested against."""

from __future__ import annotations

from typing import Sequence

from kvtier.codec.geometry import region_offsets
from kvtier.layout import Layout
from kvtier.ops.span import ChunkSpan


def _pairs(layout: Layout, span: ChunkSpan):
    """Yield ``(engine block view, chunk block view)`` for every block of the span in every region."""
    offsets = region_offsets(layout, span.num_blocks)
    for region, offset in zip(layout.regions, offsets):
        size = region.block_bytes
        for i, block_id in enumerate(span.block_ids.tolist()):
            at = offset + (span.first + i) * size
            yield region.blocks[block_id], span.buffer[at : at + size]


def gather(layout: Layout, spans: Sequence[ChunkSpan]) -> None:
    for span in spans:
        for engine_block, chunk_block in _pairs(layout, span):
            chunk_block.copy_(engine_block)


def scatter(layout: Layout, spans: Sequence[ChunkSpan]) -> None:
    for span in spans:
        for engine_block, chunk_block in _pairs(layout, span):
            engine_block.copy_(chunk_block)
