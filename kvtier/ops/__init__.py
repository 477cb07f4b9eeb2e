"""Move KV blocks between the engine's paged memory and chunk buffers.

``gather`` copies engine blocks into chunk buffers (save); ``scatter`` copies chunk buffers into
engine blocks (load). Both take a batch of :class:`ChunkSpan` so a backend can serve a whole
batch with one launch. Backends: ``cpu`` (host only: one C pass that copies and computes the chunk checksum, on a few threads,
outside the GIL), ``torch`` (``index_select`` / ``index_copy_``, any device),
``reference`` (one ``copy_`` per block and region: the naive baseline and the tests' oracle), and
on CUDA ``triton`` (zero-copy kernel over UVA), ``cuda`` (its CUDA C++ twin in ``csrc/``) and
``dma`` (a device-side pack into staging memory, then the copy engines). The CUDA backends and
``cpu`` compute the chunk checksum (:mod:`kvtier.ops.checksum`) while they copy and verify it
while they load. ``auto`` on a CPU takes ``cpu`` when it builds here, else ``torch``.
``auto`` on CUDA takes ``dma``: it alone keeps ≥ 40 GB/s beside a running model without slowing
it (measurements and the full rule: :func:`kvtier.ops.copy_path.choose_path`).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from kvtier.layout import Layout
from kvtier.ops.span import ChunkSpan


logger = logging.getLogger(__name__)

Op = Callable[[Layout, Sequence[ChunkSpan]], None]


def _backends() -> dict[str, tuple[Op, Op]]:
    from kvtier.ops import cpu_ops, reference, torch_ops

    table = {"torch": (torch_ops.gather, torch_ops.scatter), "reference": (reference.gather, reference.scatter)}
    if cpu_ops.available():
        table["cpu"] = (cpu_ops.gather, cpu_ops.scatter)
    if torch.cuda.is_available():
        from kvtier.ops import cuda_ops, dma_ops, triton_ops

        for name, module in (("dma", dma_ops), ("triton", triton_ops), ("cuda", cuda_ops)):
            if module.available():
                table[name] = (module.gather, module.scatter)
    return table


def copies_in_background(name: str) -> tuple[Callable, Callable] | None:
    """``(gather_async, scatter_async)`` of backend ``name`` when its copies run on the GPU's copy
    engines after the call returns (``dma``: :class:`kvtier.ops.dma_ops.Copying`), else None."""
    if name != "dma":
        return None
    from kvtier.ops import dma_ops

    return dma_ops.gather_async, dma_ops.scatter_async


def checksums_in_kernel(name: str) -> bool:
    """Whether backend ``name`` computes and verifies the KVSUM64 chunk checksum while copying."""
    return name in ("dma", "triton", "cuda", "cpu")


def backend_names() -> list[str]:
    """Backends usable on this machine."""
    return list(_backends())


def resolve_backend(layout: Layout, name: str = "auto") -> str:
    """The backend ``name`` stands for on this machine; ``auto``: ``dma`` > ``triton`` > ``cuda`` on CUDA,
    ``cpu`` > ``torch`` on a CPU."""
    table = _backends()
    if name == "auto":
        order = ("dma", "triton", "cuda") if layout.device.type == "cuda" else ("cpu",)
        name = next((n for n in order if n in table), "torch")
    if name == "cpu" and layout.device.type != "cpu":
        raise ValueError(f"ops backend 'cpu' copies host memory; the KV is on {layout.device}.")
    if name not in table:
        raise ValueError(f"ops backend {name!r} is not available here; choose one of {sorted(table)}.")
    return name


def describe_backend(name: str) -> str:
    """Backend ``name`` in words, e.g. ``dma (cuda kernels)`` or ``dma (triton kernels; ...)``."""
    if name != "dma":
        return name
    from kvtier.ops import cuda_ops

    if cuda_ops.available():
        return "dma (cuda kernels)"
    return f"dma (triton kernels; CUDA C++ kernels: {cuda_ops.build_error()})"


def warm_kernels(layout: Layout, name: str) -> float:
    """Compile ahead the Triton kernels that backend ``name`` and the checksum passes launch on
    this CUDA device when the CUDA C++ kernels are not built (``python -m kvtier.ops.build``), so
    the first load after start costs what the later ones do. Seconds taken (0: nothing to do)."""
    if layout.device.type != "cuda":
        return 0.0
    from kvtier.ops import cuda_ops, triton_ops

    if not triton_ops.available() or (name != "triton" and cuda_ops.available()):
        return 0.0
    try:
        return triton_ops.warm(layout.device)
    except Exception as exc:  # noqa: BLE001 - the first copy meets the same error, where a load falls back
        logger.warning("kvtier: compiling the Triton copy kernels at start failed (%s: %s); the first "
                       "copy compiles them instead.", type(exc).__name__, exc)
        return 0.0


def pick_backend(layout: Layout, name: str = "auto") -> tuple[Op, Op]:
    """``(gather, scatter)`` of backend ``name`` (see :func:`resolve_backend`)."""
    return _backends()[resolve_backend(layout, name)]


def gather(layout: Layout, spans: Sequence[ChunkSpan], backend: str = "auto") -> None:
    """Copy engine blocks into the spans' chunk payloads."""
    pick_backend(layout, backend)[0](layout, spans)


def scatter(layout: Layout, spans: Sequence[ChunkSpan], backend: str = "auto") -> None:
    """Copy the spans' chunk payloads into engine blocks."""
    pick_backend(layout, backend)[1](layout, spans)
