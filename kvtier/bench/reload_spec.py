"""The reload bench's spec and result: what to measure (:class:`ReloadSpec`) and the samples
measured (:class:`ReloadResult`, a :class:`PathTimes` per path), shared by its phases
(:mod:`kvtier.bench.reload`, :mod:`.reload_disk`, :mod:`.shared`) and its report (:mod:`.report`).

Sizes are in tokens, blocks, chunks and bytes as named; times in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier import codec
from kvtier.bench.engine_kv import Geometry

NAMESPACE = "kvtier-bench"  # store namespace: the bench never sees a real deployment's chunks
POOL_GRANULE = 4096  # the CPU pool rounds every chunk up to this (see StoreConfig)


@dataclass(frozen=True, slots=True)
class ReloadSpec:
    """What to measure. ``prompt_tokens`` is a multiple of ``chunk_tokens``, itself a multiple of
    the block size (the CLI checks both). ``disk_path``: add a disk tier there and measure a cold
    disk reload. ``repeats``: samples per path (the report picks the best or the median)."""

    geometry: Geometry
    prompt_tokens: int
    chunk_tokens: int
    device: torch.device
    backend: str = "auto"
    disk_path: str | None = None
    repeats: int = 3
    seed: int = 0
    shared_url: str | None = None
    checksum_rows: bool = True  # on a CPU with backend auto: a whole-path row per checksum candidate
    beside_gemm: bool = False  # CUDA: also save and reload in a loop beside a GEMM loop (kvtier.bench.beside_gemm)

    @property
    def chunk_blocks(self) -> int:
        return self.chunk_tokens // self.geometry.block_size

    @property
    def prompt_blocks(self) -> int:
        return self.prompt_tokens // self.geometry.block_size

    @property
    def num_chunks(self) -> int:
        return self.prompt_tokens // self.chunk_tokens

    @property
    def prompt_bytes(self) -> int:
        return self.prompt_tokens * self.geometry.bytes_per_token

    def cpu_tier_bytes(self) -> int:
        """CPU tier size: every chunk of the prompt (header included, pool-rounded) plus slack."""
        payload = self.chunk_tokens * self.geometry.bytes_per_token
        per_chunk = -(-(codec.HEADER_BYTES + payload) // POOL_GRANULE) * POOL_GRANULE
        total = per_chunk * self.num_chunks
        return total + max(64 << 20, total // 32)

    def memory_needed(self) -> tuple[int, int]:
        """(device bytes, host bytes) at the peak: engine KV (two block sets) and the CPU tier."""
        engine = 2 * self.prompt_bytes
        if self.device.type == "cuda":
            return engine, self.cpu_tier_bytes()
        return 0, engine + self.cpu_tier_bytes()


@dataclass(slots=True)
class PathTimes:
    """One path's samples in milliseconds; an empty list means the path has no such direction."""

    label: str
    save_ms: list[float] = field(default_factory=list)
    reload_ms: list[float] = field(default_factory=list)
    note: str = ""


@dataclass(slots=True)
class ReloadResult:
    """Everything the report prints. ``paths`` keeps table order; sub-paths are named ``parent.part``."""

    spec: ReloadSpec
    device_name: str
    backend: str
    layout_kind: str
    regions: int
    cpu_tier_bytes: int
    load_avg: tuple[float, float]  # 1-minute load average at start and at end
    others_cpu_s: float | None = None  # CPU seconds other processes used during the run (Linux)
    paths: dict[str, PathTimes] = field(default_factory=dict)
    verified: list[str] = field(default_factory=list)
    peak_rss_bytes: int = 0
    elapsed_s: float = 0.0
    beside_gemm: list | None = None  # [kvtier.bench.beside_gemm.BesideGemm], when measured

