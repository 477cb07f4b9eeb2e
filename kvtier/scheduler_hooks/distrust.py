"""Chunks a load found unusable, remembered so that lookups stop before them (vLLM #49176: a
request that must recompute from the start must not be offered the same failing load again)."""

from __future__ import annotations

from collections import OrderedDict

MAX_DISTRUSTED = 1 << 16  # chunk keys remembered; the oldest are forgotten first


class Distrusted:
    """Chain keys of chunks that failed to load, until they are saved again (bounded, LRU)."""

    def __init__(self, capacity: int = MAX_DISTRUSTED):
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def discard(self, key: bytes) -> None:
        """``key`` was saved again: trust it."""
        self._keys.pop(key, None)

    def clear(self) -> None:
        self._keys.clear()

    def trusted(self, keys: list[bytes], tiers: list[str]) -> tuple[str, ...]:
        """``tiers`` (one per chunk of ``keys``, as a lookup found them) up to the first distrusted chunk."""
        for i, key in enumerate(keys[: len(tiers)]):
            if key in self._keys:
                return tuple(tiers[:i])
        return tuple(tiers)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys
