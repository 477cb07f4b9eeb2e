"""The host copy library (``csrc/cpu_copy.c``): built on first use, loaded with ctypes.

Its entry point ``kvt_copy`` walks a table of units (one per region and chunk block), copies them
over a few threads and adds their KVSUM64 terms (:mod:`kvtier.ops.checksum`; ``kvt_copy2`` sums
each unit at two positions, for a join of pieces that checks them as it copies); ctypes
releases the GIL for the whole call. :mod:`kvtier.ops.cpu_ops` copies spans with it, and
:func:`payload_checksum` reads a payload with it, which is how the codec checks a chunk's KVSUM64
on the host (:mod:`kvtier.codec.checksums`).

The library is compiled with the system C compiler (``$CC`` or ``cc``, about a second) into
``$KVTIER_BUILD_DIR`` (default ``~/.cache/kvtier``), keyed by the source's hash. Without a
compiler or the source, :func:`available` is False and :func:`build_error` says why.
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

import numpy as np
import torch

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cpu_copy.c"
BYTES_PER_THREAD = 4 << 20  # a call gets one thread per this many bytes (thread start ~20 us)
_FLAGS = ["-O3", "-shared", "-fPIC", "-pthread"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None


def _build_dir() -> Path:
    return Path(os.environ.get("KVTIER_BUILD_DIR") or Path.home() / ".cache" / "kvtier")


def load() -> ctypes.CDLL | None:
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
            lib.kvt_copy2.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
            lib.kvt_copy2.restype = ctypes.c_int
            _lib = lib
        except Exception as exc:  # noqa: BLE001 - optional backend: record why and carry on
            _error = f"{type(exc).__name__}: {exc}"
        return _lib


def available() -> bool:
    """True when the C library builds (or is built) and loads here."""
    return load() is not None


def build_error() -> str | None:
    """Why :func:`available` is False (None when it is True or was never tried)."""
    return _error


def loaded() -> ctypes.CDLL:
    """The library; RuntimeError naming why it could not be built."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"the cpu ops backend is unavailable: {_error}")
    return lib


def default_threads() -> int:
    """Threads a large call uses: torch's intra-op thread count (the cores the engine was given)."""
    return max(1, torch.get_num_threads())


def payload_checksum(payload: torch.Tensor) -> int:
    """KVSUM64 of a whole contiguous host ``uint8 [P]`` payload (P a multiple of 4), read once in C."""
    lib = loaded()
    if payload.numel() % 4 or not payload.is_contiguous() or payload.device.type != "cpu":
        raise ValueError("payload must be a contiguous host tensor of a multiple of 4 bytes.")
    step = 1 << 22  # 4 MiB units, so the read splits over threads
    at = np.arange(0, payload.numel(), step, dtype=np.int64)
    units = np.zeros((at.size, 5), dtype=np.int64)  # write flag 0: read only, no engine address
    units[:, 1] = payload.data_ptr() + at
    units[:, 2] = np.minimum(step, payload.numel() - at)
    units[:, 3] = at // 4
    sums = np.zeros(1, dtype=np.uint64)
    count = max(1, min(default_threads(), payload.numel() // BYTES_PER_THREAD))
    lib.kvt_copy(units.ctypes.data, len(units), 0, sums.ctypes.data, 1, count)
    return int(sums[0])
