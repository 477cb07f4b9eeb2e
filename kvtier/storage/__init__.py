"""kvtier's chunk storage: a CPU LRU pool and an optional disk tier, over LMCache.

This package is the only place in kvtier that imports LMCache; its public types hide every
LMCache type. Sizes are in bytes.
"""

from __future__ import annotations

from ._direct import MEMORY_FILE_SYSTEMS, file_system
from ._probe import DiskSpeed
from .types import ChunkBuffer, StorageError, StoreConfig, Tier
from .store import ChunkStore  # noqa: E402  (imports LMCache; types above do not)

__all__ = ["ChunkBuffer", "DiskSpeed", "ChunkStore", "MEMORY_FILE_SYSTEMS", "StorageError", "StoreConfig", "Tier",
           "file_system"]
