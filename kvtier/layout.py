"""What kvtier knows of an engine's paged KV memory: regions of opaque fixed-size blocks.

A *region* is one paged tensor seen as bytes: ``num_blocks`` blocks, each ``block_bytes``
contiguous bytes, ``block_stride`` bytes apart. A layer has one region when each of its blocks
is one dense range of bytes, whatever the order of its dims (vLLM-CPU; vLLM 0.26's CUDA backends
in NHD or HND order; MLA), or several when a dim lies outside the block in memory (K and V in
the older ``[2, num_blocks, ...]`` flash layout; heads in vLLM 0.32's BHLNC). kvtier never
interprets the bytes inside a block; it only moves them.

A layout is *token-contiguous* when every region's block is ``[block_size, per_token...]``
densely, tokens outermost: a block's bytes are ``block_size`` equal slices, one per token (flash
attention's NHD ``[2, num_blocks, block_size, kv_heads, head_size]``, MLA's ``[num_blocks,
block_size, latent]``). Then ``n`` blocks of a region are ``n * block_size`` token slices in
token order, whatever the block size, so its fingerprint leaves the block size out: engines with
different block sizes exchange chunks unchanged (P/D). Any other layout (HND, vLLM-CPU's
``[num_blocks, kv_heads, block_size, 2*head_size]``, FlashInfer's ``[num_blocks, 2, ...]`` as one
region) fingerprints its block size.

Given the KV heads each rank holds, a layout whose blocks have one head dim is keyed by the heads
it holds, not by its TP rank (:mod:`kvtier.shards`): its ``fingerprint`` is then the same for any
rank and TP size holding those heads, and a layout without a head dim (MLA) has one fingerprint
on every rank. ``rank_fingerprint`` keeps the per-rank meaning.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
from dataclasses import dataclass, field

import torch

from kvtier.shards import HeadShard, head_bytes, head_dim, independent_text, memory_order, piece_fingerprint, rank_heads

logger = logging.getLogger(__name__)

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

    ``rank_fingerprint`` (16 bytes) covers everything that changes the meaning of a block's bytes:
    model, dtype, TP rank and size, layout version, and per-token shapes and strides when
    ``token_contiguous`` (see the module docstring), else per-block ones and the block size.
    ``fingerprint``: what chunks are stored and sealed under: the piece fingerprint of ``shard``'s
    heads (:func:`kvtier.shards.piece_fingerprint`) when ``shard`` is set, else ``rank_fingerprint``.
    """

    regions: tuple[Region, ...]
    block_size: int
    fingerprint: bytes
    description: str = ""  # the fingerprinted facts in words, for error messages
    token_contiguous: bool = False  # each region's block is block_size equal token slices, in token order
    rank_fingerprint: bytes = b""  # the per-rank fingerprint (``fingerprint`` when ``shard`` is None)
    shard: HeadShard | None = None  # the KV heads this rank's blocks hold; None: chunks are per TP rank
    _bytes_per_block: int = field(default=0, init=False, repr=False, compare=False)  # asked per chunk: summed once

    def __post_init__(self) -> None:
        object.__setattr__(self, "_bytes_per_block", sum(r.block_bytes for r in self.regions))

    @property
    def token_bytes(self) -> tuple[int, ...]:
        """Bytes of one token in each region (token-contiguous layouts only; else empty)."""
        if not self.token_contiguous:
            return ()
        return tuple(r.block_bytes // self.block_size for r in self.regions)

    @property
    def num_blocks(self) -> int:
        return self.regions[0].num_blocks

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block index holds across all regions (all layers, K and V)."""
        return self._bytes_per_block

    @property
    def device(self) -> torch.device:
        return self.regions[0].blocks.device

    def payload_bytes(self, num_blocks: int) -> int:
        """Size in bytes of ``num_blocks`` blocks packed region-major (the codec's payload)."""
        return num_blocks * self.bytes_per_block


_MAX_PARTS = 64  # regions one tensor may split into (K/V, or a few more outer dims): past it, refuse


def _block_dim(tensor: torch.Tensor, num_blocks: int) -> int | None:
    """The dim that indexes blocks: dim 0, or dim 1 behind a leading K/V dim of 2 (vLLM's flash
    layout ``[2, num_blocks, ...]``), whichever has ``num_blocks`` entries (dim 0 first, unless it
    is that K/V dim)."""
    shape = tensor.shape
    if tensor.dim() >= 3 and shape[0] == 2 and shape[1] == num_blocks and tensor.stride(0) > tensor.stride(1):
        return 1
    if shape[0] == num_blocks:
        return 0
    if tensor.dim() >= 3 and shape[0] == 2 and shape[1] == num_blocks:
        return 1
    return None


def _split_blocks(tensor: torch.Tensor, name: str, num_blocks: int) -> list[tuple[str, torch.Tensor, int]]:
    """``tensor`` as regions: ``(name, view whose dim 0 indexes blocks, block bytes)`` per region.

    A block is the set of elements at one index of the block dim. The other dims, taken by
    increasing stride, pack the block densely for as long as each stride equals the elements
    packed so far: the view may list its dims in any order (vLLM permutes them with each attention
    backend's stride order). The first dim that breaks that, and every dim after it, splits the
    block: each index of those dims is a region of its own (K and V in vLLM's ``[2, num_blocks,
    ...]`` flash layout; heads whose blocks interleave with other layers' in vLLM 0.32's BHLNC).
    Regions may interleave in memory but never share a byte.
    """
    def refuse(why: str) -> LayoutError:
        return LayoutError(f"KV tensor {name!r} (shape {tuple(tensor.shape)}, strides {tensor.stride()}, "
                           f"dtype {tensor.dtype}) {why}; kvtier copies whole blocks and refuses to guess this layout.")

    dim = _block_dim(tensor, num_blocks) if tensor.dim() >= 2 else None
    if dim is None:
        raise refuse(f"has no block dim: expected [num_blocks={num_blocks}, ...] or [2, num_blocks={num_blocks}, ...]")
    shape, strides = tensor.shape, tensor.stride()
    block_stride = strides[dim]
    others = sorted((d for d in range(tensor.dim()) if d != dim and shape[d] > 1), key=lambda d: strides[d])
    dense, split = 1, []
    for d in others:
        if not split and strides[d] == dense and strides[d] < block_stride:
            dense *= shape[d]
        elif strides[d] < dense:
            raise refuse(f"packs dim {d} into bytes other dims already use")
        else:
            split.append(d)
    if block_stride < dense and num_blocks > 1:
        raise refuse(f"has overlapping blocks (block stride {block_stride} < {dense} elements per block)")
    parts = math.prod(shape[d] for d in split)
    if parts > _MAX_PARTS:
        raise refuse(f"splits each block into {parts} separate ranges")
    starts = [sum(i * strides[d] for d, i in zip(split, index))
              for index in itertools.product(*(range(shape[d]) for d in split))]
    if not _disjoint(starts, block_stride, dense, shape[dim]):
        raise refuse("has blocks that share bytes across the dims that split them")
    kv_pair = dim == 1 and split == [0] and shape[0] == 2  # vLLM's [2, num_blocks, ...]: K, then V
    regions = []
    for index in itertools.product(*(range(shape[d]) for d in split)):
        part = tensor
        for d, i in sorted(zip(split, index), reverse=True):  # select from the back: earlier dims keep their number
            part = part.select(d, i)
        block = part.movedim(dim - sum(d < dim for d in split), 0)
        suffix = ("." + "kv"[index[0]]) if kv_pair else "".join(f".{i}" for i in index)
        regions.append((name + suffix, block, dense * tensor.element_size()))
    return regions


def _disjoint(starts: list[int], stride: int, size: int, count: int) -> bool:
    """Whether regions starting at ``starts`` (elements), each ``count`` blocks of ``size``
    elements ``stride`` apart, share no element: two regions either lie apart as wholes, or their
    offset modulo the block stride leaves room for a block on both sides."""
    span = (count - 1) * stride + size
    ordered = sorted(starts)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if b - a >= span:
                break
            gap = (b - a) % stride if count > 1 else b - a
            if b == a or gap < size or (count > 1 and stride - gap < size):
                return False
    return True


def _byte_view(block: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """``block`` (dim 0 indexes blocks, each one dense range starting at its element 0) as a
    ``uint8 [num_blocks, block_bytes]`` alias of the engine's memory."""
    item = block.element_size()
    view = torch.empty(0, dtype=torch.uint8, device=block.device)
    view.set_(block.untyped_storage(), block.storage_offset() * item, (block.shape[0], block_bytes),
              (block.stride(0) * item, 1))
    return view


def build_layout(
    kv_caches: dict[str, torch.Tensor],
    block_size: int,
    num_blocks: int,
    *,
    model: str = "",
    tp_rank: int = 0,
    tp_size: int = 1,
    kv_heads: int | None = None,
    total_kv_heads: int = 0,
) -> Layout:
    """Layout of the per-layer KV tensors an engine registers.

    Each tensor is ``[num_blocks, ...]`` or ``[2, num_blocks, ...]`` in its view's dim order, with
    any strides that keep each block one dense range of bytes, or a few ranges when a dim lies
    outside the block dim in memory (see :func:`_split_blocks`): vLLM-CPU's ``[num_blocks,
    kv_heads, block_size, 2*head_size]``, flash attention's ``[2, num_blocks, block_size, kv_heads,
    head_size]`` (K and V as two regions) in NHD or HND order, FlashInfer's and Triton attention's
    ``[num_blocks, 2, ...]``, MLA's ``[num_blocks, block_size, latent]``, in any dtype (fp8 too).
    Layers that alias the same memory (KV sharing) give one region. Anything else raises
    :class:`LayoutError` naming the tensor, its shape and its strides.

    ``kv_heads``: KV heads per rank, of ``total_kv_heads`` (0: the KV has no head dim and is the
    same on every rank, MLA); None keys chunks per TP rank. See :func:`_head_shard`.
    """
    if not kv_caches:
        raise LayoutError("no KV tensors were registered.")
    if block_size <= 0 or num_blocks <= 0:
        raise LayoutError(f"block_size ({block_size}) and num_blocks ({num_blocks}) must be positive.")
    regions: list[Region] = []
    described: list[str] = []  # per region, name:dtype:block shape:strides
    per_token: list[str] = []  # the same per token, while every region keeps tokens outermost
    seen: set[tuple[int, int, int]] = set()
    blocks: list[tuple[str, torch.Tensor, int, int | None]] = []  # (name, block view, block bytes, token dim)
    for name, tensor in kv_caches.items():
        for part_name, block, block_bytes in _split_blocks(tensor, name, num_blocks):
            view = _byte_view(block, block_bytes)
            where = (view.data_ptr(), view.stride(0), block_bytes)
            if where in seen:  # a layer that shares another's KV (vLLM's KV sharing): its bytes are saved once
                continue
            seen.add(where)
            regions.append(Region(part_name, view))
            described.append(f"{part_name}:{block.dtype}:{tuple(block.shape[1:])}:{block[0].stride()}")
            blocks.append((part_name, block, block_bytes, token := _token_dim(block, block_size, block_bytes)))
            if token is not None:
                one = block[0].select(token - 1, 0)  # one token of one block
                per_token.append(f"{part_name}:{block.dtype}:token dim {token - 1}:{tuple(one.shape)}:{one.stride()}")
    devices = {r.blocks.device for r in regions}
    if len(devices) != 1:
        raise LayoutError(f"KV tensors span several devices ({sorted(map(str, devices))}); one device per worker is supported.")
    token_contiguous = len(per_token) == len(described)
    if token_contiguous:  # no block size: "tokens" can never be read as one
        text = "|".join([f"v{LAYOUT_VERSION}", model, "tokens", f"tp{tp_rank}/{tp_size}", *per_token])
    else:
        text = "|".join([f"v{LAYOUT_VERSION}", model, f"bs{block_size}", f"tp{tp_rank}/{tp_size}", *described])
    rank_fingerprint = fingerprint = hashlib.blake2b(text.encode(), digest_size=16).digest()
    shard = _head_shard(blocks, kv_heads, total_kv_heads, tp_rank, tp_size, model, block_size, token_contiguous)
    if isinstance(shard, str):
        if tp_rank == 0 and kv_heads is not None:  # asked for and refused: said once per engine
            logger.warning("kvtier stores chunks per TP rank (readable only at TP size %d): %s.", tp_size, shard)
        shard = None
    else:
        fingerprint = piece_fingerprint(shard.base, None if shard.replicated else (shard.first, shard.end))
    order = ("token-contiguous: any block size matches" if token_contiguous
             else "not token-contiguous: the block size must match")
    keyed = ("per TP rank" if shard is None else "one piece for every rank" if shard.replicated
             else f"piece of KV heads {shard.first}-{shard.end} of {shard.total}")
    description = (f"[model {model or '?'}, block size {block_size} ({order}), TP rank {tp_rank}/{tp_size} ({keyed}), "
                   f"{len(regions)} regions like {described[0]} (name:dtype:block shape:strides), "
                   f"fingerprint {fingerprint.hex()[:12]}]")
    return Layout(tuple(regions), block_size, fingerprint, description, token_contiguous, rank_fingerprint, shard)


def _head_shard(blocks: list[tuple[str, torch.Tensor, int, int | None]], kv_heads: int | None, total: int,
                tp_rank: int, tp_size: int, model: str, block_size: int, token_contiguous: bool) -> HeadShard | str:
    """The heads this rank's regions ``blocks`` hold and their TP-independent fingerprint, or why the
    chunks stay per TP rank: no head counts given, heads replicated across ranks (fewer KV heads than
    ranks), or a region whose head dim is missing, ambiguous, outside the block or not whole runs.
    The block size is left out only when tokens stay outermost at any head count: heads inside the
    token dim in memory (one head per rank makes vLLM-CPU's block look token-contiguous; it is not)."""
    if kv_heads is None:
        return "the engine gave no KV head count"
    if kv_heads and (total != kv_heads * tp_size or kv_heads < 1):
        return f"{kv_heads} KV heads per rank at TP size {tp_size} do not split the model's {total} evenly"
    dims, sizes = [], []
    for name, block, block_bytes, _ in blocks:
        dim = head_dim(block, kv_heads) if kv_heads else None
        size = dim if isinstance(dim, str) or dim is None else head_bytes(block, dim, block_bytes)
        if isinstance(size, str):
            return f"KV tensor {name!r}: {size}"
        dims.append(dim)
        sizes.append(size)
    tokens = token_contiguous and all(dim is None or memory_order(block, dim) > memory_order(block, token)
                                      for dim, (_, block, _, token) in zip(dims, blocks))
    texts = [f"v{LAYOUT_VERSION}", model, "tokens" if tokens else f"bs{block_size}",
             f"heads{total if kv_heads else 'replicated'}"]
    texts += [f"{name}:{block.dtype}:{independent_text(block, dim, token if tokens else None)}"
              for dim, (name, block, _, token) in zip(dims, blocks)]
    base = hashlib.blake2b("|".join(texts).encode(), digest_size=16).digest()
    if not kv_heads:
        return HeadShard(base, 0, 0, 0)
    return HeadShard(base, *rank_heads(total, tp_rank, tp_size), total, tuple(sizes))


def _token_dim(block: torch.Tensor, block_size: int, block_bytes: int) -> int | None:
    """The dim of ``block`` (dim 0 indexes blocks; each block one dense range of ``block_bytes``)
    that indexes tokens, when it is outermost in memory: each block is then ``block_size``
    consecutive slices of ``block_bytes / block_size`` bytes, token ``i`` in slice ``i``. None
    when the outermost dim is not ``block_size`` long (HND: heads outermost). Its place in the
    view's dim order is fingerprinted too: an HND block whose heads happen to number
    ``block_size`` cannot pass for one whose tokens are outermost.
    """
    dims = [d for d in range(1, block.dim()) if block.shape[d] > 1]
    if block_size == 1 or not dims:  # one token per block: nothing tells the token dim apart
        return None
    outer = max(dims, key=block.stride)
    if block.shape[outer] != block_size or block.stride(outer) * block.element_size() * block_size != block_bytes:
        return None
    return outer
