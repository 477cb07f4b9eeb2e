"""CUDA C++ gather/scatter (``csrc/kv_copy.cu``): the Triton backend's twin, plus DMA helpers.

Same :class:`~kvtier.ops.triton_ops.CopyPlan`, same semantics and checksum as
:mod:`kvtier.ops.triton_ops`; the tests check both give identical bytes and sums. The extension
is built with ``torch.utils.cpp_extension.load`` (nvcc and ninja, once per machine and sources,
into :func:`build_directory`; the binding avoids torch headers to build fast): ahead of time by
``python -m kvtier.ops.build``, or on first use outside an engine. It is optional: when CUDA, nvcc, the
``csrc/`` sources or the build are missing, :func:`available` is False and :func:`build_error`
says why. Importing this module builds nothing.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from kvtier.layout import Layout
from kvtier.ops.span import ChunkSpan
from kvtier.ops.triton_ops import CopyPlan, run_copy

CSRC = Path(__file__).resolve().parents[2] / "csrc"
DEFAULT_MAX_CTAS = 8  # idle H200: 64 KiB in flight per CTA, so 4-8 CTAs reach the PCIe plateau
DEFAULT_THREADS = 512  # 16 warps x 32 lanes x 8 vectors x 16 B = 64 KiB in flight per CTA

_lock = threading.Lock()
_ext = None
_error: str | None = None
_build_allowed = True


@functools.lru_cache(maxsize=1)
def _build_name() -> str:
    """The extension's name: fixed by its sources, torch and CUDA, so a build on disk is the one
    these sources need, and a check for it never compiles anything."""
    digest = hashlib.blake2b(digest_size=6)
    for path in (CSRC / "kv_copy.cu", CSRC / "binding.cpp"):
        digest.update(path.read_bytes() if path.exists() else b"")
    digest.update(f"{torch.__version__}|{torch.version.cuda}".encode())
    return f"kvtier_kv_copy_{digest.hexdigest()}"


def build_directory() -> Path:
    """Where the build lives: ``$KVTIER_BUILD_DIR``, else ``~/.cache/kvtier/ext`` (one folder per build name)."""
    root = os.environ.get("KVTIER_BUILD_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvtier", "ext")
    return Path(root) / _build_name()


def is_built() -> bool:
    """Whether the extension for these sources is on disk (so loading it compiles nothing)."""
    return (build_directory() / f"{_build_name()}.so").exists()


def allow_build(allowed: bool) -> None:
    """Whether :func:`available` may compile the extension (tens of seconds with nvcc) when it is
    not built yet. An engine's worker forbids it: nothing compiles while an engine starts, and the
    copies take the Triton kernels until ``python -m kvtier.ops.build`` has built it."""
    global _build_allowed
    _build_allowed = allowed


def _load():
    """The compiled extension module, or None (reason in :func:`build_error`). Built once."""
    global _ext, _error
    with _lock:
        if _ext is not None or _error is not None:
            return _ext
        try:
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device")
            from torch.utils.cpp_extension import CUDA_HOME, load

            if CUDA_HOME is None:
                raise RuntimeError("nvcc not found (CUDA_HOME unset)")
            sources = [CSRC / "kv_copy.cu", CSRC / "binding.cpp"]
            missing = [str(p) for p in sources if not p.exists()]
            if missing:
                raise RuntimeError(f"sources missing: {missing}")
            if not _build_allowed and not is_built():
                raise RuntimeError("not built yet (build it ahead with: python -m kvtier.ops.build)")
            directory = build_directory()
            directory.mkdir(parents=True, exist_ok=True)
            _ext = load(
                name=_build_name(),
                sources=[str(p) for p in sources],
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3"],
                build_directory=str(directory),
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - optional backend: record why and carry on
            _error = f"{type(exc).__name__}: {exc}"
        return _ext


def available() -> bool:
    """True when the extension is loaded (built now if needed and :func:`allow_build` allows it)
    and CUDA is usable."""
    return _load() is not None


def build_error() -> str | None:
    """Why :func:`available` is False, once it has been called."""
    return _error


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def launch(
    plan: CopyPlan, *, gather: bool, sums: torch.Tensor | None = None, max_ctas: int | None = None, threads: int = DEFAULT_THREADS
) -> None:
    """Enqueue the CUDA C++ copy of ``plan`` on the current stream (``sums``: ``int64 [S]``, added to)."""
    ext = _load()
    if ext is None:
        raise RuntimeError(f"the CUDA C++ ops backend is unavailable: {_error}")
    ext.kv_copy(
        plan.anchor.data_ptr(), plan.regions.data_ptr(), plan.blocks.data_ptr(), plan.ids.data_ptr(),
        0 if sums is None else sums.data_ptr(), plan.regions.shape[0], plan.blocks.shape[0],
        gather, sums is not None, max_ctas or DEFAULT_MAX_CTAS, threads, _stream(),
    )


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data_as(ctypes.c_void_p).value or 0


def memcpy_blocks(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: torch.cuda.Stream, *, batched: bool = True) -> None:
    """Enqueue ``len(dsts)`` copies (``int64`` addresses and byte counts, host arrays) on ``stream``.

    ``batched``: one ``cudaMemcpyBatchAsync`` (falls back to a loop where the runtime is older than
    12.8); else one ``cudaMemcpyAsync`` each. ``stream`` must not be the legacy default stream.
    """
    ext = _load()
    if ext is None:
        raise RuntimeError(f"the CUDA C++ ops backend is unavailable: {_error}")
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (dsts, srcs, sizes)]
    fn = ext.memcpy_batch if batched else ext.memcpy_loop
    fn(*(_ptr(a) for a in arrays), len(arrays[0]), stream.cuda_stream)


def gather(layout: Layout, spans: Sequence[ChunkSpan], checksums_out: torch.Tensor | None = None, *, max_ctas: int | None = None) -> None:
    """As :func:`kvtier.ops.triton_ops.gather`, with the CUDA C++ kernel."""
    run_copy(layout, spans, launch, gather=True, checksums_out=checksums_out, max_ctas=max_ctas)


def scatter(
    layout: Layout, spans: Sequence[ChunkSpan], expected_checksums: Sequence[int] | torch.Tensor | None = None, *, max_ctas: int | None = None
) -> list[bool]:
    """As :func:`kvtier.ops.triton_ops.scatter`, with the CUDA C++ kernel (same garbage-on-mismatch rule)."""
    return run_copy(layout, spans, launch, gather=False, expected_checksums=expected_checksums, max_ctas=max_ctas)
