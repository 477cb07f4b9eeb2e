"""``index_select`` / ``index_copy_`` per region: one gather or scatter per region and chunk, any device."""

from __future__ import annotations

from typing import Sequence

import torch

from kvtier.codec.geometry import region_offsets
from kvtier.layout import Layout
from kvtier.ops.span import ChunkSpan


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as int64 words when alignment allows: torch moves uint8 rows byte by byte (~6x slower)."""
    try:
        return rows.view(torch.int64)
    except RuntimeError:
        return rows


def _chunk_rows(layout: Layout, span: ChunkSpan):
    """Yield ``(engine blocks, chunk rows)`` per region: ``[num_blocks, w]`` and ``[k, w]``, same word type."""
    k = span.block_ids.numel()
    for region, offset in zip(layout.regions, region_offsets(layout, span.num_blocks)):
        start = offset + span.first * region.block_bytes
        rows = span.buffer[start : start + k * region.block_bytes].view(k, region.block_bytes)
        blocks, wide_rows = _wide(region.blocks), _wide(rows)
        if blocks.dtype != wide_rows.dtype:
            blocks, wide_rows = region.blocks, rows
        yield blocks, wide_rows


def gather(layout: Layout, spans: Sequence[ChunkSpan]) -> None:
    for span in spans:
        for blocks, rows in _chunk_rows(layout, span):
            if rows.device == blocks.device:
                torch.index_select(blocks, 0, span.block_ids, out=rows)
            else:  # device blocks into a host chunk: gather on the device, then one copy
                rows.copy_(blocks.index_select(0, span.block_ids), non_blocking=True)
    if layout.device.type == "cuda":
        torch.cuda.current_stream(layout.device).synchronize()


def scatter(layout: Layout, spans: Sequence[ChunkSpan]) -> None:
    for span in spans:
        for blocks, rows in _chunk_rows(layout, span):
            blocks.index_copy_(0, span.block_ids, rows.to(blocks.device, non_blocking=True))
    if layout.device.type == "cuda":
        torch.cuda.current_stream(layout.device).synchronize()
