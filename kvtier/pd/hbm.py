"""Engine KV memory as NIXL sees it: the regions of :mod:`kvtier.layout`, registered once, and
the descriptors of a block-to-block READ, one per run of consecutive blocks.

Registration covers each region's whole span of blocks (overlapping or touching spans merged),
once per rank at start, never per transfer. A transfer's descriptors pair a run of consecutive
blocks on both sides with one ``(address, bytes)`` per region where the region's blocks are
dense (stride = block bytes), else one per block: NIXL's post time grows with the descriptor
count, so a 32k-token prompt of a 32-layer model read in 256-token chunks is 32 descriptors a
chunk when the blocks are consecutive, not 512.

Whether UCX reaches the peer's GPU memory directly (``cuda_ipc`` between GPUs of one host,
GPUDirect RDMA across hosts) or emulates it through the host shows only in how fast a READ
goes (two engines on one GPU, a VM or PCIe host without peer-to-peer: ~0.4 GB/s, so a 32k
prompt's 4 GiB would take 10 s against the CPU-tier path's ~1.7 s). So the first time a
consumer reaches a producer HBM to HBM, before it asks for any chunk, it times one READ of the
producer's first blocks (any bytes do: none is used) into the engine blocks of the transfer at
hand (the request's own, about to be written anyway: READ again, scattered from the CPU tier,
or recomputed when the transfer fails), after a one-block READ that pays the connection's
wire-up (:func:`kvtier.pd.consumer.probe.direct_path`). One line says which it is; an emulated path is turned off for
that producer, whose chunks then come from its CPU tier. Later READs and a producer's WRITEs are
timed too (:func:`read_speed`).

Block ids and regions a peer gives are checked before any descriptor is built
(:func:`blocks_problem`, :func:`region_problem`): the registration merges the spans of
interleaved regions, so NIXL would take a block id past the end of one region as bytes of its
neighbour's.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.layout import Layout

if TYPE_CHECKING:  # types only: the producer's leases and checksums of the blocks it lends
    from kvtier.pd.producer.leases import BlockLeases
    from kvtier.pd.producer.sums import EarlySums

logger = logging.getLogger(__name__)

EMULATED_GBPS = 2.0  # the fastest of a producer's first READs slower than this, GB/s: emulated
TIMED_READS = 3  # READs timed per producer before judging
TIMED_MIN_BYTES = 4 << 20  # smaller READs time their latency, not the path's bandwidth
JUDGED_KINDS = ("VRAM",)  # memory whose path is judged (host memory always moves at host speed)
_lock = threading.Lock()
_timed: dict[str, list[float]] = {}  # producer endpoint -> GB/s of its first READs
_emulated: set[str] = set()
ADDRESS_SPACE = 1 << 63  # bytes: no region of a peer's engine KV ends beyond this


@dataclass(frozen=True, slots=True)
class RegionSpan:
    """One region of engine KV: ``base`` address, ``stride`` bytes between blocks, ``block_bytes``."""

    base: int
    stride: int
    block_bytes: int


@dataclass(frozen=True, slots=True)
class EngineBlocks:
    """What a producer rank lends HBM to HBM: its engine KV ``regions`` on CUDA device ``device``
    (this process's index), registered as ``kind`` ("VRAM" or "DRAM"), the ``leases`` of its
    requests' blocks, ``bytes_per_block`` over all regions, and the ``sums`` of its published
    chunks taken as each step ends (None: only a stored chunk's checksum is known).
    ``num_blocks``: blocks of each region (told to consumers, which check the ids lent)."""

    regions: tuple[RegionSpan, ...]
    device: int
    leases: BlockLeases
    bytes_per_block: int
    kind: str = "VRAM"
    sums: EarlySums | None = None
    num_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Landing:
    """A consumer's engine KV where chunks may land HBM to HBM: its ``regions``, registered with
    NIXL as ``kind`` ("VRAM" of CUDA device ``device``, this process's index, or "DRAM"), and per
    item of a fetch the engine blocks that chunk may be written into (None: not that one): READ
    from the producer's blocks, or WRITTEN by it (the transfer's route: :mod:`kvtier.pd.route`).
    ``num_blocks``: blocks of each region (told to producers, which check the ids a push names)."""

    regions: tuple[RegionSpan, ...]
    kind: str
    device: int
    block_ids: list[tuple[int, ...] | None]
    num_blocks: int = 0


def read_speed(endpoint: str, kind: str, nbytes: int, seconds: float, op: str = "READ") -> None:
    """Time one of the first READs of GPU memory (``kind`` VRAM) from producer ``endpoint`` (or,
    ``op`` "WRITE", a producer's WRITEs into the consumer ``endpoint``); after
    :data:`TIMED_READS` of them say how fast its HBM path is, and turn it off if emulated. (A
    consumer probes a producer's path before its first request: :mod:`kvtier.pd.consumer.probe`.)"""
    if kind not in JUDGED_KINDS or nbytes < TIMED_MIN_BYTES:
        return
    with _lock:
        rates = _timed.setdefault(endpoint, [])
        if len(rates) >= TIMED_READS:
            return
        rates.append(nbytes / max(seconds, 1e-9) / 1e9)
        if len(rates) < TIMED_READS:
            return
    _verdict(endpoint, op)


def judge(endpoint: str, gbps: float) -> None:
    """The path to ``endpoint`` moved ``gbps`` GB/s in a probe: judged now, as after :data:`TIMED_READS` READs."""
    with _lock:
        _timed[endpoint] = [gbps] * TIMED_READS
    _verdict(endpoint, "test READ")


def judged(endpoint: str, kind: str = "VRAM") -> bool:
    """Whether the path to ``endpoint`` for memory ``kind`` needs no probe: judged already (probed,
    or timed over its first READs), or memory that is not judged."""
    with _lock:
        return kind not in JUDGED_KINDS or len(_timed.get(endpoint, ())) >= TIMED_READS


def _verdict(endpoint: str, op: str) -> None:
    """Say how fast the path to ``endpoint`` is, and turn it off if emulated (its rates are all in)."""
    with _lock:
        best = max(_timed[endpoint])
        if best < EMULATED_GBPS:
            _emulated.add(endpoint)
    if best < EMULATED_GBPS:
        logger.warning("kvtier P/D: HBM to HBM %ss with %s moved at most %.2f GB/s: UCX has no direct GPU path "
                       "here (no cuda_ipc, no GPUDirect RDMA); its transfers go through the CPU tiers.",
                       op, endpoint, best)
    else:
        logger.info("kvtier P/D: HBM to HBM with %s at %.1f GB/s per %s (a direct path: cuda_ipc or "
                    "GPUDirect RDMA).", endpoint, best, op)


def emulated(endpoint: str) -> bool:
    """Whether READs from ``endpoint``'s engine KV were found emulated (see :func:`read_speed`)."""
    with _lock:
        return endpoint in _emulated


def region_spans(layout: Layout) -> tuple[RegionSpan, ...]:
    """The layout's regions as addresses."""
    return tuple(RegionSpan(r.blocks.data_ptr(), r.block_stride, r.block_bytes) for r in layout.regions)


def registration(spans: tuple[RegionSpan, ...], num_blocks: int) -> list[tuple[int, int]]:
    """``(address, bytes)`` ranges covering every block of every region, merged where they
    overlap or touch (regions of one allocation interleave)."""
    ranges = sorted((s.base, s.base + (num_blocks - 1) * s.stride + s.block_bytes) for s in spans)
    merged: list[list[int]] = []
    for start, end in ranges:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


def region_problem(spans: tuple[RegionSpan, ...], num_blocks: int) -> str:
    """Why a peer's engine KV regions ``spans`` of ``num_blocks`` blocks each cannot be (a stride
    under its block's bytes, a span past :data:`ADDRESS_SPACE`, regions without blocks), in
    words; "" if they can (none given included)."""
    if not spans:
        return ""
    if num_blocks < 1:
        return f"{len(spans)} engine KV regions of {num_blocks} blocks"
    for i, s in enumerate(spans):
        if s.block_bytes < 1 or s.stride < s.block_bytes:
            return f"engine KV region {i} has a stride of {s.stride} B for blocks of {s.block_bytes} B"
        if s.base + (num_blocks - 1) * s.stride + s.block_bytes > ADDRESS_SPACE:
            return f"engine KV region {i} of {num_blocks} blocks of stride {s.stride} B overflows the address space"
    return ""


def blocks_problem(ids: tuple[int, ...] | list[int], num_blocks: int) -> str:
    """Why block ids ``ids`` do not all name one of ``num_blocks`` engine blocks, in words ("" if they do)."""
    beyond = [b for b in ids if not 0 <= b < num_blocks]
    return f"block {beyond[0]} is beyond its engine's {num_blocks} blocks" if beyond else ""


def block_runs(src: tuple[int, ...] | list[int], dst: tuple[int, ...] | list[int]) -> list[tuple[int, int, int]]:
    """``(src block, dst block, count)`` runs where both sides' block ids go up by one together."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def compatible(mine: tuple[RegionSpan, ...], theirs: tuple[RegionSpan, ...]) -> bool:
    """Whether blocks may be copied region for region, byte for byte (same count and sizes)."""
    return len(mine) == len(theirs) and all(a.block_bytes == b.block_bytes for a, b in zip(mine, theirs))


def read_descriptors(local: tuple[RegionSpan, ...], remote: tuple[RegionSpan, ...], local_ids, remote_ids,
                     ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Paired ``(address, bytes)`` lists to READ ``remote_ids`` (the peer's blocks) into
    ``local_ids`` (this engine's), every region. Raises ValueError on mismatched regions."""
    if not compatible(local, remote):
        raise ValueError("the engines' KV regions differ in count or block size")
    runs = block_runs(list(remote_ids), list(local_ids))
    mine: list[tuple[int, int]] = []
    theirs: list[tuple[int, int]] = []
    for lr, rr in zip(local, remote):
        n = lr.block_bytes
        dense = lr.stride == n and rr.stride == n
        for src, dst, count in runs:
            if dense:
                theirs.append((rr.base + src * n, count * n))
                mine.append((lr.base + dst * n, count * n))
            else:
                for i in range(count):
                    theirs.append((rr.base + (src + i) * rr.stride, n))
                    mine.append((lr.base + (dst + i) * lr.stride, n))
    return mine, theirs
