"""``index_select`` / ``index_copy_`` per region: one gather or scatter per region and chunk, any device."""

from __future__ import annotations

from typing import Sequence

import torch

from kvtier.codec import region_offsets
from kvtier.layout import Layout
from kvtier.ops import ChunkSpan


def _chunk_rows(layout: Layout, span: ChunkSpan):
    """Yield ``(region, rows)``: the span's blocks of each region in the chunk, ``uint8 [k, block_bytes]``."""
    k = span.block_ids.numel()
    for region, offset in zip(layout.regions, region_offsets(layout, span.num_blocks)):
        start = offset + span.first * region.block_bytes
        yield region, span.buffer[start : start + k * region.block_bytes].view(k, region.block_bytes)


def gather(layout: Layout, spans: Sequence[ChunkSpan]) -> None:
    for span in spans:
        for region, rows in _chunk_rows(layout, span):
            if rows.device == region.blocks.device:
                torch.index_select(region.blocks, 0, span.block_ids, out=rows)
            else:  # device blocks into a host chunk: gather on the device, then one copy
                rows.copy_(region.blocks.index_select(0, span.block_ids), non_blocking=True)
    if layout.device.type == "cuda":
        torch.cuda.current_stream(layout.device).synchronize()


def scatter(layout: Layout, spans: Sequence[ChunkSpan]) -> None:
    for span in spans:
        for region, rows in _chunk_rows(layout, span):
            region.blocks.index_copy_(0, span.block_ids, rows.to(region.blocks.device, non_blocking=True))
    if layout.device.type == "cuda":
        torch.cuda.current_stream(layout.device).synchronize()
