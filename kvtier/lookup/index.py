"""Rank 0's record of what every worker rank holds: the only source of lookup answers.

A chunk is *committed*, and visible to lookups, once every rank of the TP group has reported
holding it; a report from any rank that it lost the chunk withdraws it for all. Ranks store a
chunk under their own storage key (the chain key bound to the rank's layout fingerprint), so the
index keeps each rank's keys and fingerprint and maps a looked-up chain key to each of them.

A rank whose chunks are pieces keyed by the KV heads they hold (:mod:`kvtier.shards`) also holds
a chunk when it holds every piece that another TP size's ranks stored of its heads (a disk tier
written at another TP size): its load builds its own piece from them. Those keys are made only
for a chunk whose own piece is missing, from fingerprints made once per report's layout.
"""

from __future__ import annotations

from kvtier.keys import storage_key
from kvtier.lookup.protocol import HoldReport
from kvtier.shards import covers, piece_fingerprint

_SLOWER = {"cpu": 0, "disk": 1}
MEMO_KEYS = 1 << 16  # chain keys whose storage keys are remembered (~5 MiB at TP=2)


class HoldIndex:
    """Storage keys held by each of ``world_size`` ranks, with their tier. Not thread-safe: the
    lookup server reads and changes it under its lock."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._fingerprints: list[bytes | None] = [None] * world_size
        self._held: list[dict[bytes, str]] = [{} for _ in range(world_size)]
        self._covers: list[list[tuple[bytes, ...]]] = [[] for _ in range(world_size)]  # piece fingerprints per way
        # chain key -> each rank's storage key: a hash per rank and chunk is most of a lookup's
        # cost, and the scheduler asks about the same prompt every step it waits.
        self._memo: dict[bytes, tuple[bytes, ...]] = {}

    def apply(self, report: HoldReport) -> str | None:
        """Record ``report``; returns why it was refused (nothing recorded), or None."""
        if report.world_size != self.world_size:
            return f"rank {report.rank} reports world size {report.world_size}, the server has {self.world_size}"
        if report.rank >= self.world_size:
            return f"rank {report.rank} is outside world size {self.world_size}"
        if len(report.keys) != len(report.tiers):
            return f"rank {report.rank} sent {len(report.keys)} keys but {len(report.tiers)} tiers"
        held = self._held[report.rank]
        if self._fingerprints[report.rank] != report.fingerprint:
            # A new layout on that rank (a restarted worker): what it held before means nothing.
            self._fingerprints[report.rank] = report.fingerprint
            first, end, total = report.heads if len(report.heads) == 3 and report.base else (0, 0, 0)
            self._covers[report.rank] = [tuple(piece_fingerprint(report.base, heads) for heads in way)
                                         for way in (covers(first, end, total) if total else ())]
            held.clear()
            self._memo.clear()
        for key, tier in zip(report.keys, report.tiers):
            if tier:
                held[key] = tier
            else:
                held.pop(key, None)
        return None

    def prefix_tiers(self, keys: list[bytes]) -> list[str]:
        """Tiers of the leading chain ``keys`` that every rank holds: the slowest rank's tier."""
        if any(fingerprint is None for fingerprint in self._fingerprints):
            return []  # a rank that never reported holds nothing yet
        tiers: list[str] = []
        for key in keys:
            slowest = "cpu"
            for rank, (skey, held) in enumerate(zip(self._storage_keys(key), self._held)):
                tier = held.get(skey) or self._covered(key, rank)
                if tier is None:
                    return tiers
                if _SLOWER[tier] > _SLOWER[slowest]:
                    slowest = tier
            tiers.append(slowest)
        return tiers

    def ranks_keys(self, keys: list[bytes]) -> tuple[tuple[bytes, ...], list[tuple[bytes, ...]]] | None:
        """(every rank's fingerprint, every rank's storage key of each chain key), or None while
        some rank has not reported yet (its storage keys are unknown)."""
        if any(fingerprint is None for fingerprint in self._fingerprints):
            return None
        return tuple(self._fingerprints), [self._storage_keys(key) for key in keys]

    def cover_rows(self, keys: list[bytes]) -> list[list[tuple[bytes, ...]]]:
        """Per way other TP sizes' ranks store pieces of these ranks' heads (fewest pieces first):
        each chain key's pieces every rank needs, storage keys without repeats (the shared tier's
        question, :meth:`LookupServer._tiers`). Empty for ranks of per-rank or replicated layouts."""
        if not all(self._covers) or any(len(c) != len(self._covers[0]) for c in self._covers):
            return []
        ways = [tuple(dict.fromkeys(fp for rank in self._covers for fp in rank[j])) for j in range(len(self._covers[0]))]
        return [[tuple(storage_key(key, fp) for fp in way) for key in keys] for way in ways]

    def _storage_keys(self, key: bytes) -> tuple[bytes, ...]:
        skeys = self._memo.get(key)
        if skeys is None:
            if len(self._memo) >= MEMO_KEYS:
                self._memo.clear()
            skeys = self._memo[key] = tuple(storage_key(key, fp) for fp in self._fingerprints)
        return skeys

    def _covered(self, key: bytes, rank: int) -> str | None:
        """The slowest tier of the first way ``rank`` holds every piece of chain key ``key`` another
        TP size stored; None when there is none."""
        held = self._held[rank]
        for way in self._covers[rank]:
            tiers = [held.get(storage_key(key, fingerprint)) for fingerprint in way]
            if None not in tiers:
                return max(tiers, key=_SLOWER.__getitem__)
        return None

    def held_count(self, rank: int) -> int:
        """Chunks ``rank`` holds (for tests and logs)."""
        return len(self._held[rank])
