"""Public value types of ``kvtier.storage``; nothing here touches LMCache.

Units: every size is in bytes. Ownership rules for :class:`ChunkBuffer` are on the class.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvtier.urls import redact, shared_url_problem

logger = logging.getLogger(__name__)

# Goes verbatim into LMCache key strings ("ns@world@worker@hash@dtype") and so into file
# names; '@', '%', '/' and ',' all have meaning there, so allow only a safe alphabet.
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class StorageError(ValueError):
    """A :class:`StoreConfig` that cannot work; the message names the offending field."""


class Tier(enum.Enum):
    """Where a chunk lives; CPU is faster than DISK. SHARED is a Redis/Valkey server that many
    engines share (not P/D's "remote": chunks fetched from a prefill engine)."""

    CPU = "cpu"
    DISK = "disk"
    SHARED = "shared"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Sizes and placement of a :class:`~kvtier.storage.ChunkStore`.

    ``cpu_bytes``: size of the CPU LRU pool in bytes (allocated up front, pinned when CUDA
    exists). ``disk_path``: directory of the disk tier, ``None`` for no disk tier; created if
    missing. ``disk_bytes``: disk tier capacity in bytes, counted in the CPU allocator's aligned
    chunk sizes (4 KiB granules); must be > 0 when ``disk_path`` is set. ``namespace``,
    ``worker_id`` and ``world_size`` go into every key, so stores with different values never see
    each other's chunks even in one directory. One live store per (disk_path, namespace,
    worker_id) at a time, unless their keys never meet (TP ranks' pieces of other KV heads). ``o_direct``: read disk chunks with O_DIRECT, bypassing the page cache
    (buffered where the file system refuses it, with one warning). ``write_through``: False keeps
    chunks put here in CPU only: their disk and shared copies are another store's to write (TP
    ranks that hold the same KV store it once), though this store still reads them.

    ``shared_url``: ``redis://[:password@]host:port[/db]`` of a Redis or Valkey server shared by
    many engines (``valkey://`` means the same), ``None`` for no shared tier. Every chunk put is
    written through to it in the background; a get that misses CPU and disk reads it from there.
    ``shared_timeout_ms``: most milliseconds one network operation on it may take (connect, read,
    write). ``shared_write_bytes``: most bytes of writes to it in flight; beyond it, writes are
    dropped and counted (0: a quarter of ``cpu_bytes``).
    """

    cpu_bytes: int
    disk_path: str | None = None
    disk_bytes: int = 0
    namespace: str = "kvtier"
    worker_id: int = 0
    world_size: int = 1
    o_direct: bool = False
    shared_url: str | None = None
    shared_timeout_ms: int = 1000
    shared_write_bytes: int = 0
    write_through: bool = True

    def __post_init__(self) -> None:
        # Only checks that need no file system; ChunkStore checks disk_path is writable.
        if not _is_int(self.cpu_bytes) or self.cpu_bytes <= 0:
            raise StorageError(f"cpu_bytes must be a positive int, got {self.cpu_bytes!r}.")
        if self.disk_path is not None:
            if not isinstance(self.disk_path, str) or not self.disk_path:
                raise StorageError(f"disk_path must be a non-empty str, got {self.disk_path!r}.")
            if "," in self.disk_path:
                # LMCache reads local_disk as a comma-separated list of directories.
                raise StorageError(f"disk_path '{self.disk_path}' must not contain ','.")
            if not _is_int(self.disk_bytes) or self.disk_bytes <= 0:
                raise StorageError(
                    f"disk_bytes must be a positive int when disk_path is set, "
                    f"got {self.disk_bytes!r}."
                )
        if not isinstance(self.namespace, str) or not _NAMESPACE_RE.match(self.namespace):
            raise StorageError(
                f"namespace {self.namespace!r} must be 1-64 characters of [A-Za-z0-9_.-]."
            )
        if not isinstance(self.o_direct, bool):
            raise StorageError(f"o_direct must be a bool, got {self.o_direct!r}.")
        if self.shared_url is not None:
            problem = shared_url_problem(self.shared_url)
            if problem:
                raise StorageError(f"shared_url {redact(self.shared_url)!r} {problem}.")
        if not _is_int(self.shared_timeout_ms) or self.shared_timeout_ms <= 0:
            raise StorageError(f"shared_timeout_ms must be a positive int, got {self.shared_timeout_ms!r}.")
        if not _is_int(self.shared_write_bytes) or self.shared_write_bytes < 0:
            raise StorageError(f"shared_write_bytes must be an int >= 0, got {self.shared_write_bytes!r}.")
        if not _is_int(self.world_size) or self.world_size < 1:
            raise StorageError(f"world_size must be an int >= 1, got {self.world_size!r}.")
        if not _is_int(self.worker_id) or not 0 <= self.worker_id < self.world_size:
            raise StorageError(
                f"worker_id must be an int in [0, world_size), got {self.worker_id!r}."
            )


# One lock for every buffer: release() is rare next to the copies it guards, and a lock per
# buffer would cost more memory than contention ever would.
_RELEASE_LOCK = threading.Lock()


class ChunkBuffer:
    """A chunk's bytes in a tier-owned host buffer.

    ``data``: 1-D ``torch.uint8`` tensor of exactly the bytes asked for, a view into a buffer of
    the store's CPU pool (pinned host memory when CUDA exists). ``tier``: where the bytes came
    from (``Tier.CPU`` for a freshly allocated buffer).

    Ownership: whoever receives a ChunkBuffer owns one reference to the pool memory and must
    call :meth:`release` exactly once (a second call is a no-op), unless it hands the buffer to
    ``ChunkStore.put``, which takes the reference over. Buffers returned by ``get`` share their
    memory with the cached chunk: read them, never write them. After ``ChunkStore.close`` every
    buffer is released and ``data`` becomes empty; views taken of ``data`` earlier then point
    into freed memory and must not be used.
    """

    __slots__ = ("data", "tier", "_obj", "_on_release", "__weakref__")

    def __init__(
        self,
        data: torch.Tensor,
        tier: Tier,
        obj: Any,
        on_release: Callable[[ChunkBuffer], None] | None = None,
    ) -> None:
        # Built only by ChunkStore: `obj` is the pool object whose reference this buffer owns
        # (anything with ref_count_down()), `on_release` lets the store forget the buffer.
        self.data = data
        self.tier = tier
        self._obj = obj
        self._on_release = on_release

    @property
    def released(self) -> bool:
        """True once the buffer no longer owns pool memory (released, put, or store closed)."""
        return self._obj is None

    def release(self) -> None:
        """Give the pool memory back; idempotent."""
        obj = self._detach()
        if obj is not None:
            obj.ref_count_down()

    def _detach(self) -> Any:
        """Take the owned reference out of the buffer (for release or a transfer to put)."""
        with _RELEASE_LOCK:
            obj, self._obj = self._obj, None
        if obj is not None and self._on_release is not None:
            self._on_release(self)
        return obj

    def __repr__(self) -> str:
        state = "released" if self._obj is None else "held"
        return f"ChunkBuffer(nbytes={self.data.numel()}, tier={self.tier.name}, {state})"

    def __del__(self) -> None:
        # Safety net only: a dropped buffer would otherwise pin its chunk in the pool forever
        # (it can never be evicted while referenced).
        try:
            if self._obj is not None:
                logger.warning("ChunkBuffer garbage-collected without release(); releasing it")
                self.release()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass
