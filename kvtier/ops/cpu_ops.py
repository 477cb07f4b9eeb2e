"""Host gather/scatter in C (``csrc/cpu_copy.c``): one pass that copies and computes KVSUM64.

The CPU twin of the CUDA kernels: same semantics and checksum as :mod:`kvtier.ops.triton_ops`
(``gather(..., checksums_out=)``, ``scatter(..., expected_checksums=) -> ok per span``), so a chunk
saved by either verifies on the other. A batch becomes one table of units (one per region and
chunk block) and one C call that splits it over a few threads; ctypes releases the GIL for the
whole call, so an engine loop in the same interpreter keeps running while KV moves.

The library is compiled on first use with the system C compiler (``$CC`` or ``cc``, about a
second) into ``$KVTIER_BUILD_DIR`` (default ``~/.cache/kvtier``), keyed by the source's hash.
Without a compiler or the source, :func:`available` is False, :func:`build_error` says why, and
``auto`` falls back to the ``torch`` backend with a host checksum.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from kvtier.codec import HEADER_BYTES
from kvtier.layout import Layout
from kvtier.ops import ChunkSpan
from kvtier.ops.checksum import to_signed, to_unsigned

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cpu_copy.c"
BYTES_PER_THREAD = 4 << 20  # a batch gets one thread per this many bytes (thread start ~20 us)
_FLAGS = ["-O3", "-shared", "-fPIC", "-pthread"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None


def _build_dir() -> Path:
    return Path(os.environ.get("KVTIER_BUILD_DIR") or Path.home() / ".cache" / "kvtier")


def _load() -> ctypes.CDLL | None:
    """The compiled library, or None (reason in :func:`build_error`). Built once per source version."""
    global _lib, _error
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        try:
            source = SOURCE.read_bytes()
            cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if cc is None:
                raise RuntimeError("no C compiler (set CC)")
            digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
            target = _build_dir() / f"kvtier_cpu_copy_{digest}.so"
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
                os.close(fd)
                try:  # compile aside, then rename: processes starting together never see half a file
                    subprocess.run([cc, *_FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True)
                    os.replace(tmp, target)
                except subprocess.CalledProcessError as exc:
                    raise RuntimeError(f"{cc} failed: {exc.stderr.strip()[:400]}") from None
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            lib = ctypes.CDLL(str(target))
            lib.kvt_copy.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
            lib.kvt_copy.restype = ctypes.c_int
            _lib = lib
        except Exception as exc:  # noqa: BLE001 - optional backend: record why and carry on
            _error = f"{type(exc).__name__}: {exc}"
        return _lib


def available() -> bool:
    """True when the C library builds (or is built) and loads here."""
    return _load() is not None


def build_error() -> str | None:
    """Why :func:`available` is False (None when it is True or was never tried)."""
    return _error


def default_threads() -> int:
    """Threads a large batch uses: torch's intra-op thread count (the cores the engine was given)."""
    return max(1, torch.get_num_threads())


def build_units(layout: Layout, spans: Sequence[ChunkSpan], *, complement: bool = False) -> np.ndarray:
    """``int64 [units, 5]``: per (span block, region) engine address, chunk address, bytes, word
    index in the chunk payload, ``span << 1 | write``. ``complement`` adds read-only units for
    each span's other chunk blocks, so its checksum covers the whole chunk."""
    regions = layout.regions
    block_bytes = np.array([r.block_bytes for r in regions], dtype=np.int64)
    if np.any(block_bytes % 4):
        raise ValueError("every region's block size must be a multiple of 4 bytes.")
    stride = np.array([r.block_stride for r in regions], dtype=np.int64)
    base = np.array([r.blocks.data_ptr() for r in regions], dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(block_bytes)[:-1]]).astype(np.int64)  # bytes before region r in one block
    rows = []  # per span: (span, chunk block j, engine block id, write, payload address, n)
    for s, span in enumerate(spans):
        if span.buffer.device.type != "cpu" or not span.buffer.is_contiguous():
            raise ValueError(f"span {s}: chunk buffer must be a contiguous host tensor.")
        n, k = span.num_blocks, span.block_ids.numel()
        if span.buffer.numel() < HEADER_BYTES + n * int(block_bytes.sum()):
            raise ValueError(f"span {s}: chunk buffer of {span.buffer.numel()} B is too small for {n} blocks.")
        ids = span.block_ids.reshape(-1).to("cpu", torch.int64).numpy()
        if k and (ids.min() < 0 or ids.max() >= layout.num_blocks):
            raise ValueError(f"span {s}: block ids outside 0..{layout.num_blocks - 1}.")
        j = np.arange(span.first, span.first + k, dtype=np.int64)
        bid, write = ids, np.ones(k, dtype=np.int64)
        if complement and k < n:
            rest = np.setdiff1d(np.arange(n, dtype=np.int64), j)
            j = np.concatenate([j, rest])
            bid = np.concatenate([bid, np.zeros(rest.size, dtype=np.int64)])
            write = np.concatenate([write, np.zeros(rest.size, dtype=np.int64)])
        payload = span.buffer.data_ptr() + HEADER_BYTES
        rows.append(np.stack([np.full(j.size, s), j, bid, write, np.full(j.size, payload), np.full(j.size, n)], axis=1))
    if not rows:
        return np.zeros((0, 5), dtype=np.int64)
    s, j, bid, write, payload, n = np.concatenate(rows).T[:, :, None]  # [rows, 1] each, against [R] regions
    chunk_off = n * prefix + j * block_bytes  # byte offset inside the payload, region-major
    units = np.empty((s.shape[0], len(regions), 5), dtype=np.int64)
    units[..., 0] = base + bid * stride
    units[..., 1] = payload + chunk_off
    units[..., 2] = block_bytes
    units[..., 3] = chunk_off // 4
    units[..., 4] = (s << 1) | write
    return units.reshape(-1, 5)


def run_copy(layout: Layout, spans: Sequence[ChunkSpan], *, gather: bool, want_sums: bool, complement: bool = False,
             threads: int | None = None) -> list[int] | None:
    """Copy ``spans`` in one C call; the spans' KVSUM64s (unsigned) when ``want_sums``."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the cpu ops backend is unavailable: {_error}")
    if layout.device.type != "cpu":
        raise ValueError(f"the cpu ops backend copies host memory; this layout is on {layout.device}.")
    units = np.ascontiguousarray(build_units(layout, spans, complement=complement))
    sums = np.zeros(len(spans), dtype=np.uint64) if want_sums else None
    nbytes = int(units[:, 2].sum()) if len(units) else 0
    count = max(1, min(threads or default_threads(), nbytes // BYTES_PER_THREAD))
    rc = lib.kvt_copy(units.ctypes.data, len(units), int(gather), None if sums is None else sums.ctypes.data,
                      len(spans), count)
    if rc != 0:
        raise MemoryError("kvtier cpu copy: out of memory for its thread table.")
    return None if sums is None else [int(v) for v in sums]


def gather(layout: Layout, spans: Sequence[ChunkSpan], checksums_out: torch.Tensor | None = None) -> None:
    """Copy engine blocks into the spans' chunk payloads.

    ``checksums_out``: optional ``int64 [len(spans)]`` that receives each span's KVSUM64 over its
    own blocks at their chunk positions (the chunk's checksum when the span covers the chunk).
    """
    sums = run_copy(layout, spans, gather=True, want_sums=checksums_out is not None)
    if checksums_out is not None:
        checksums_out.copy_(torch.tensor([to_signed(v) for v in sums], dtype=torch.int64))


def scatter(layout: Layout, spans: Sequence[ChunkSpan],
            expected_checksums: Sequence[int] | torch.Tensor | None = None) -> list[bool]:
    """Copy the spans' chunk payloads into engine blocks, verifying while copying.

    ``expected_checksums``: per span, the KVSUM64 of its WHOLE chunk payload (unsigned ints or
    ``int64``); a partial span also reads the rest of its chunk. Returns ``ok`` per span; a span
    with ``ok == False`` has written garbage into its engine blocks, which the caller must report
    as failed (recomputed), never use.
    """
    if expected_checksums is None:
        run_copy(layout, spans, gather=False, want_sums=False)
        return [True] * len(spans)
    if isinstance(expected_checksums, torch.Tensor):
        expected = [to_unsigned(v) for v in expected_checksums.tolist()]
    else:
        expected = [to_unsigned(int(v)) for v in expected_checksums]
    if len(expected) != len(spans):
        raise ValueError(f"{len(expected)} expected checksums for {len(spans)} spans.")
    sums = run_copy(layout, spans, gather=False, want_sums=True, complement=True)
    return [a == b for a, b in zip(sums, expected)]


def payload_checksum(payload: torch.Tensor) -> int:
    """KVSUM64 of a whole contiguous host ``uint8 [P]`` payload (P a multiple of 4), read once in C."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the cpu ops backend is unavailable: {_error}")
    if payload.numel() % 4 or not payload.is_contiguous() or payload.device.type != "cpu":
        raise ValueError("payload must be a contiguous host tensor of a multiple of 4 bytes.")
    step = 1 << 22  # 4 MiB units, so the read splits over threads
    at = np.arange(0, payload.numel(), step, dtype=np.int64)
    units = np.zeros((at.size, 5), dtype=np.int64)
    units[:, 1] = payload.data_ptr() + at
    units[:, 2] = np.minimum(step, payload.numel() - at)
    units[:, 3] = at // 4
    sums = np.zeros(1, dtype=np.uint64)
    count = max(1, min(default_threads(), payload.numel() // BYTES_PER_THREAD))
    lib.kvt_copy(units.ctypes.data, len(units), 0, sums.ctypes.data, 1, count)
    return int(sums[0])
