"""Which copy path moves a batch between engine blocks and pinned host chunks on CUDA.

:func:`choose_path` is a pure function of what the caller knows (is the GPU busy, how many bytes,
which paths run here), so the rule and the measurements behind it can be read, and tested, in
one place; the paths themselves are :mod:`kvtier.ops.triton_ops`, :mod:`kvtier.ops.cuda_ops`
and :mod:`kvtier.ops.dma_ops`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from kvtier.ops import cuda_ops, dma_ops, triton_ops


@dataclass(frozen=True, slots=True)
class CopyPath:
    """Which backend moves a batch: ``backend`` in ``triton | cuda | dma | torch``; ``max_ctas``
    for the kernel backends (or the staged DMA's pack kernel); ``mode`` for ``dma``."""

    backend: str
    max_ctas: int | None = None
    mode: str | None = None


STAGED_MIN_BYTES = 512 << 20
"""Idle GPU: below this batch size a zero-copy kernel beats staged DMA (whose pack and DMA only
overlap from the second slot on). Measured save/load GB/s, kernel vs staged: 1 chunk (32 MiB)
33/31 vs 22/24; 4 chunks 44/42 vs 31/34; 16 chunks (512 MiB) 48/46 vs 46/50."""


def usable_paths() -> set[str]:
    """Which of ``triton``, ``cuda`` (builds the extension if needed) and ``dma`` run here."""
    probes = (("triton", triton_ops.available), ("cuda", cuda_ops.available), ("dma", dma_ops.available))
    return {name for name, probe in probes if probe()}


def choose_path(*, gpu_busy: bool, batch_bytes: int, paths: Collection[str] | None = None, staging: bool = True) -> CopyPath:
    """How to move one batch of ``batch_bytes`` payload bytes between engine blocks and pinned chunks.

    ``gpu_busy``: model kernels are running or queued (SMs are not free). ``paths``: usable paths
    among ``triton``, ``cuda``, ``dma`` (default :func:`usable_paths`). ``staging``: whether
    :data:`~kvtier.ops.dma_ops.DEFAULT_STAGE_BYTES` of device memory may be used.

    Measured on an H200 (PCIe Gen5 x16; raw pinned memcpy 55.3 GB/s each way), Llama-3-8B-like
    geometry (64 regions x 32 KiB blocks; 4 GiB in 128 chunks of 16 shuffled blocks), checksums on
    (``bench/gpu_copy.py``, ``bench/results/gpu_copy.json``). Idle save / load GB/s; then copy GB/s
    and GEMM slowdown beside a bf16 8192^3 GEMM loop (run-to-run noise ~1%):

    - staged DMA, C++ pack 4 CTAs, 4 x 128 MiB slots: 52.5 / 53.1 (0.95 / 0.96 of raw); 43.7, -0.7%
      (another run: 41.8, 1.5%). Triton pack 16 CTAs: 52.6 / 52.2; 44.1, -0.4%.
    - staged DMA with 8 x 32 MiB slots: 52.6 / 52.4 idle but 25.2 busy (each pack launch waits
      ~1-2 GEMM kernels for SMs): hence few, large slots.
    - batch DMA (cudaMemcpyBatchAsync per block) + checksum pass: 33.1 / 32.8; 28.6, 1.0%.
      Without checksums: 49.6 / 49.3; 34.4, ~0%.
    - zero-copy Triton kernel, 16 CTAs: 49.4 / 48.4 (0.89 / 0.88); busy 45.5 at 34.9% slowdown;
      8 CTAs 41.8 at 19.7%; 4 CTAs 28.4 at 7.5%. CUDA C++ 8 CTAs: 49.4 / 48.6; busy 45.7 at 31%;
      1 CTA 25.7 at 2.9%. Every SM-resident copy costs a long GEMM far more than its share of SMs.
    - for reference, one contiguous memcpy: 55.3 / 55.3; busy 54.8 at -0.2%. Naive per-block
      copies: 1.8 / 1.9. torch backend: 17.7 / 19.1.

    Rule: (1) staged DMA whenever staging is allowed and the GPU is busy or the batch is at least
    :data:`STAGED_MIN_BYTES`; (2) idle GPU and a small batch: zero-copy kernel (Triton 16 CTAs,
    else C++ 8 CTAs), ~1.0 ms per 32 MiB chunk instead of 1.5 ms; (3) busy GPU without staging:
    batch DMA + checksum pass (C++ extension) else Triton with 4 CTAs; (4) no CUDA path: torch.
    """
    available = usable_paths() if paths is None else set(paths)
    if "dma" in available and staging and (gpu_busy or batch_bytes >= STAGED_MIN_BYTES):
        return CopyPath("dma", None, "staged")
    if gpu_busy:
        if "dma" in available and "cuda" in available:
            return CopyPath("dma", None, "batch")
        if "triton" in available:
            return CopyPath("triton", 4)
        if "cuda" in available:
            return CopyPath("cuda", 1)
    if "triton" in available:
        return CopyPath("triton", triton_ops.DEFAULT_MAX_CTAS)
    if "cuda" in available:
        return CopyPath("cuda", cuda_ops.DEFAULT_MAX_CTAS)
    return CopyPath("torch")
