"""What kvtier knows of an engine's paged KV memory: regions of opaque fixed-size blocks.

A *region* is one paged tensor seen as bytes: ``num_blocks`` blocks, each ``block_bytes``
contiguous bytes, ``block_stride`` bytes apart. A layer has one region (vLLM-CPU: K and V in
one block) or two (CUDA flash layouts: K and V as separate tensors). kvtier never interprets
the bytes inside a block; it only moves them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

# Version of the layout fingerprint's text. Not the chunk format's version (kvtier.codec.FORMAT_VERSION):
# a chunk of an older format keeps its storage key, so a load finds it, rejects it and removes it.
LAYOUT_VERSION = 1


class LayoutError(ValueError):
    """The engine handed kvtier KV memory it cannot address safely."""


@dataclass(frozen=True, slots=True)
class Region:
    """One paged KV tensor as bytes.

    ``blocks`` is a ``uint8`` view ``[num_blocks, block_bytes]`` with row stride ``block_stride``
    that aliases the engine's memory (writes go straight into the engine's KV cache).
    """

    name: str
    blocks: torch.Tensor

    @property
    def block_bytes(self) -> int:
        return self.blocks.shape[1]

    @property
    def block_stride(self) -> int:
        return self.blocks.stride(0)

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]


@dataclass(frozen=True, slots=True)
class Layout:
    """All regions of all layers, in a fixed order, plus the fingerprint of their byte format.

    ``fingerprint`` (16 bytes) covers everything that changes the meaning of a block's bytes:
    model, dtype, per-block shapes and strides, block size, TP rank and size, layout version.
    """

    regions: tuple[Region, ...]
    block_size: int
    fingerprint: bytes
    description: str = ""  # the fingerprinted facts in words, for error messages

    @property
    def num_blocks(self) -> int:
        return self.regions[0].num_blocks

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block index holds across all regions (all layers, K and V)."""
        return sum(r.block_bytes for r in self.regions)

    @property
    def device(self) -> torch.device:
        return self.regions[0].blocks.device

    def payload_bytes(self, num_blocks: int) -> int:
        """Size in bytes of ``num_blocks`` blocks packed region-major (the codec's payload)."""
        return num_blocks * self.bytes_per_block


def _byte_view(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` with blocks on dim 0 as a ``uint8 [num_blocks, block_bytes]`` alias."""
    if tensor.dim() < 2:
        raise LayoutError(f"KV tensor {name!r} has shape {tuple(tensor.shape)}: need blocks on dim 0 and at least one more dim.")
    block = tensor[0]
    if not block.is_contiguous():
        raise LayoutError(
            f"KV tensor {name!r} (shape {tuple(tensor.shape)}, strides {tensor.stride()}) does not keep each "
            "block contiguous; kvtier copies whole blocks and refuses to guess this layout."
        )
    item = tensor.element_size()
    block_bytes = block.numel() * item
    stride = tensor.stride(0) * item
    if stride < block_bytes:
        raise LayoutError(f"KV tensor {name!r}: blocks overlap (stride {stride} B < block {block_bytes} B).")
    offset = tensor.storage_offset() * item
    view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    view.set_(tensor.untyped_storage(), offset, (tensor.shape[0], block_bytes), (stride, 1))
    return view


def build_layout(
    kv_caches: dict[str, torch.Tensor],
    block_size: int,
    num_blocks: int,
    *,
    model: str = "",
    tp_rank: int = 0,
    tp_size: int = 1,
) -> Layout:
    """Layout of the per-layer KV tensors an engine registers.

    Each tensor is either ``[num_blocks, ...]`` (one region: vLLM-CPU's
    ``[num_blocks, kv_heads, block_size, 2*head_size]``, FlashInfer's ``[num_blocks, 2, ...]``) or
    ``[2, num_blocks, ...]`` (K and V as two regions: vLLM's flash-attention layout). Anything
    else, or a block that is not contiguous, raises :class:`LayoutError`.
    """
    if not kv_caches:
        raise LayoutError("no KV tensors were registered.")
    if block_size <= 0 or num_blocks <= 0:
        raise LayoutError(f"block_size ({block_size}) and num_blocks ({num_blocks}) must be positive.")
    regions: list[Region] = []
    described: list[str] = []
    for name, tensor in kv_caches.items():
        if tensor.shape[0] == num_blocks:
            parts = {name: tensor}
        elif tensor.dim() >= 3 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks:
            parts = {f"{name}.k": tensor[0], f"{name}.v": tensor[1]}
        else:
            raise LayoutError(
                f"KV tensor {name!r} has shape {tuple(tensor.shape)}; expected [num_blocks={num_blocks}, ...] "
                f"or [2, num_blocks={num_blocks}, ...]."
            )
        for part_name, part in parts.items():
            regions.append(Region(part_name, _byte_view(part, part_name)))
            described.append(f"{part_name}:{part.dtype}:{tuple(part.shape[1:])}:{part[0].stride()}")
    devices = {r.blocks.device for r in regions}
    if len(devices) != 1:
        raise LayoutError(f"KV tensors span several devices ({sorted(map(str, devices))}); one device per worker is supported.")
    text = "|".join([f"v{LAYOUT_VERSION}", model, f"bs{block_size}", f"tp{tp_rank}/{tp_size}", *described])
    fingerprint = hashlib.blake2b(text.encode(), digest_size=16).digest()
    description = (f"[model {model or '?'}, block size {block_size}, TP rank {tp_rank}/{tp_size}, "
                   f"{len(regions)} regions like {described[0]} (name:dtype:block shape:strides), "
                   f"fingerprint {fingerprint.hex()[:12]}]")
    return Layout(tuple(regions), block_size, fingerprint, description)
