"""Move KV blocks between the engine's paged memory and chunk buffers.

``gather`` copies engine blocks into chunk buffers (save); ``scatter`` copies chunk buffers into
engine blocks (load). Both take a batch of :class:`ChunkSpan` so a backend can serve a whole
batch with one launch. Backends: ``torch`` (``index_select`` / ``index_copy_``, any device),
``reference`` (one ``copy_`` per block and region: the naive baseline and the tests' oracle), and
on CUDA ``triton`` (see :mod:`kvtier.ops.triton_ops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvtier.layout import Layout


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
        if not 0 <= self.first and self.first + self.block_ids.numel() <= self.num_blocks:
            raise ValueError(
                f"span of {self.block_ids.numel()} blocks from {self.first} exceeds a chunk of {self.num_blocks} blocks."
            )


Op = Callable[[Layout, Sequence[ChunkSpan]], None]


def _backends() -> dict[str, tuple[Op, Op]]:
    from kvtier.ops import reference, torch_ops

    table = {"torch": (torch_ops.gather, torch_ops.scatter), "reference": (reference.gather, reference.scatter)}
    if torch.cuda.is_available():
        from kvtier.ops import triton_ops

        if triton_ops.available():
            table["triton"] = (triton_ops.gather, triton_ops.scatter)
    return table


def backend_names() -> list[str]:
    """Backends usable on this machine."""
    return list(_backends())


def pick_backend(layout: Layout, name: str = "auto") -> tuple[Op, Op]:
    """``(gather, scatter)`` of backend ``name``; ``auto`` takes the fastest one for the layout's device."""
    table = _backends()
    if name == "auto":
        name = "triton" if layout.device.type == "cuda" and "triton" in table else "torch"
    if name not in table:
        raise ValueError(f"ops backend {name!r} is not available here; choose one of {sorted(table)}.")
    return table[name]


def gather(layout: Layout, spans: Sequence[ChunkSpan], backend: str = "auto") -> None:
    """Copy engine blocks into the spans' chunk payloads."""
    pick_backend(layout, backend)[0](layout, spans)


def scatter(layout: Layout, spans: Sequence[ChunkSpan], backend: str = "auto") -> None:
    """Copy the spans' chunk payloads into engine blocks."""
    pick_backend(layout, backend)[1](layout, spans)
