"""The engine's paged KV memory as the benches stand it up: allocation, block sets, checks.

One allocation of random bytes in the layout the engine on that device uses, twice the prompt's
blocks, so a prompt can be saved from one shuffled half and reloaded into the other.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from kvtier.bench.common import BenchError, VerifyError
from kvtier.layout import Layout, build_layout


@dataclass(frozen=True, slots=True)
class Geometry:
    """The model's KV shape. ``block_size`` in tokens."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers, K and V."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class EngineKV:
    """The engine's KV memory, its layout, and a prompt's two block sets.

    ``memory``: ``uint8 [2 * prompt_blocks * bytes per block]`` on the device; every region
    aliases it. ``src`` / ``dst``: ``int64 [prompt_blocks]`` on the device, disjoint shuffled
    block ids the prompt is saved from and reloaded into. ``kind``: the layout in words.
    """

    memory: torch.Tensor
    layout: Layout
    src: torch.Tensor
    dst: torch.Tensor
    kind: str


def make_engine_kv(geometry: Geometry, prompt_blocks: int, device: torch.device, seed: int = 0,
                   model: str = "kvtier-bench") -> EngineKV:
    """``2 * prompt_blocks`` blocks of random bytes, shaped as vLLM shapes them on ``device``:
    on CUDA the flash layout (per layer ``[2, blocks, block_size, kv_heads, head_dim]``: a K and a
    V region), elsewhere vLLM-CPU's (per layer ``[blocks, kv_heads, block_size, 2*head_dim]``)."""
    g = geometry
    num_blocks = 2 * prompt_blocks
    memory = torch.empty(num_blocks * g.block_size * g.bytes_per_token, dtype=torch.uint8, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    (memory.view(torch.int64) if memory.numel() % 8 == 0 else memory).random_(generator=generator)
    typed = memory.view(g.dtype)
    if device.type == "cuda":
        per_layer = typed.view(g.layers, 2, num_blocks, g.block_size, g.kv_heads, g.head_dim)
        kind = "flash: per layer [2, blocks, block_size, kv_heads, head_dim], K and V regions"
    else:
        per_layer = typed.view(g.layers, num_blocks, g.kv_heads, g.block_size, 2 * g.head_dim)
        kind = "vllm-cpu: per layer [blocks, kv_heads, block_size, 2*head_dim], one region"
    kv_caches = {f"model.layers.{i}.self_attn.attn": per_layer[i] for i in range(g.layers)}
    layout = build_layout(kv_caches, g.block_size, num_blocks, model=model)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    return EngineKV(memory, layout, perm[:prompt_blocks].to(device), perm[prompt_blocks:].to(device), kind)


def verify_blocks(layout: Layout, src: torch.Tensor, dst: torch.Tensor, what: str) -> None:
    """Raise :class:`VerifyError` naming the first bad block unless blocks ``dst`` equal blocks
    ``src`` (``int64 [n]`` each) byte for byte in every region.

    Compares ~8 MiB of blocks at a time through reused scratch: fresh 100 MiB temporaries would
    cost more in page faults than the comparison itself.
    """
    scratch: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for region in layout.regions:
        rows = _words(region.blocks)
        step = max(1, (8 << 20) // region.block_bytes)
        for at in range(0, len(src), step):
            s, d = src[at : at + step], dst[at : at + step]
            shape = (len(s), rows.shape[1])
            if shape not in scratch:
                scratch[shape] = (rows.new_empty(shape), rows.new_empty(shape))
            saved, loaded = scratch[shape]
            torch.index_select(rows, 0, s, out=saved)
            torch.index_select(rows, 0, d, out=loaded)
            if not torch.equal(saved, loaded):
                bad = (saved != loaded).any(dim=1).nonzero().flatten().tolist()
                raise VerifyError(
                    f"{what}: region {region.name!r} block {int(d[bad[0]])} differs from saved block {int(s[bad[0]])} "
                    f"({len(bad)} of the {len(s)} blocks compared with it differ)."
                )


def clobber_blocks(layout: Layout, block_ids: torch.Tensor) -> None:
    """Zero ``block_ids`` in every region, so that a reload writing nothing fails verification."""
    for region in layout.regions:
        _words(region.blocks).index_fill_(0, block_ids, 0)


def _words(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks`` (``uint8 [n, block_bytes]``) as ``int64`` rows when aligned: torch's CPU
    index_fill_ and equal run byte by byte on uint8, ~5x slower than on 8-byte words."""
    try:
        return blocks.view(torch.int64)
    except RuntimeError:
        return blocks


@contextlib.contextmanager
def host_buffer(nbytes: int, device: torch.device) -> Iterator[torch.Tensor]:
    """``uint8 [nbytes]`` of touched host memory, page-locked in place when ``device`` is CUDA;
    unlocked and freed when the block exits.

    Registered rather than taken from torch's pinned allocator, which rounds every block up to a
    power of two (a 4 GiB + 64 B buffer would pin 8 GiB) and keeps it cached after it is freed.
    """
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    if device.type != "cuda":
        yield buf
        return
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise BenchError(f"could not page-lock {nbytes} B of host memory (cudaHostRegister error {int(err)}).")
    try:
        yield buf
    finally:
        torch.cuda.synchronize(device)
        cudart.cudaHostUnregister(buf.data_ptr())
