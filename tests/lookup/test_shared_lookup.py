"""Rank 0's lookup server asks the shared tier for the chunks past the ranks' own hits: with the
right storage key for every rank, only while every rank has reported, and tagged "shared"."""

from __future__ import annotations

import time
import uuid

from kvtier.keys import storage_key
from kvtier.lookup import HoldReporter, LookupClient, LookupServer

A, B, C, D = (bytes([c]) * 16 for c in b"abcd")
FINGERPRINTS = (b"0" * 16, b"1" * 16)


class SharedStore:
    """Stands for the shared server: the storage keys it holds, and what it was asked."""

    def __init__(self, held: set[bytes]):
        self.held = held
        self.asked: list[tuple[list[tuple[bytes, ...]], tuple[bytes, ...]]] = []

    def __call__(self, chunks, fingerprints) -> int:
        self.asked.append((chunks, fingerprints))
        count = 0
        for row in chunks:
            if not all(k in self.held for k in row):
                break
            count += 1
        return count


def wait_for(client: LookupClient, keys: list[bytes], expected: list[str], timeout: float = 10.0) -> bool:
    """Ask until the answer is `expected`; False (with the last answer logged by pytest) on timeout."""
    deadline = time.monotonic() + timeout
    while (got := client.prefix_tiers(keys)) != expected:
        if time.monotonic() > deadline:
            print(f"last answer: {got}")
            return False
        time.sleep(0.01)
    return True


def test_the_shared_tier_answers_past_the_local_hit_for_every_rank(tmp_path):
    both = {storage_key(k, fp) for k in (B, C) for fp in FINGERPRINTS}
    shared = SharedStore(both | {storage_key(D, FINGERPRINTS[0])})  # rank 1 lacks D
    server = LookupServer(f"ipc://{tmp_path}/{uuid.uuid4().hex[:8]}.sock", 2, shared_prefix=shared)
    client = LookupClient(server.endpoint, 2000)
    local = {storage_key(A, fp): "cpu" for fp in FINGERPRINTS}
    reporters = []
    try:
        assert client.prefix_tiers([A, B]) == []  # no rank has reported: storage keys unknown, nothing asked
        assert shared.asked == []
        reporters = [HoldReporter(server.endpoint, r, 2, FINGERPRINTS[r], local.get) for r in (0, 1)]
        for reporter in reporters:
            reporter.changed([storage_key(A, reporter.fingerprint)])
            assert reporter.flush()
        # flush() means sent; the server applies the reports on its own thread
        assert wait_for(client, [A, B, C, D], ["cpu", "shared", "shared"])  # D: not every rank's shard
        chunks, fingerprints = shared.asked[-1]
        assert fingerprints == FINGERPRINTS
        assert chunks == [tuple(storage_key(k, fp) for fp in FINGERPRINTS) for k in (B, C, D)]  # past the local hit
        asked = len(shared.asked)
        assert client.prefix_tiers([A]) == ["cpu"]  # a whole local hit never asks
        assert len(shared.asked) == asked
    finally:
        client.close()
        for reporter in reporters:
            reporter.close()
        server.close()


def test_a_fresh_rank_is_known_before_it_saves_anything(tmp_path):
    """A new engine reloads from the shared tier before it has stored a single chunk."""
    shared = SharedStore({storage_key(A, FINGERPRINTS[0])})
    server = LookupServer(f"ipc://{tmp_path}/{uuid.uuid4().hex[:8]}.sock", 1, shared_prefix=shared)
    reporter = HoldReporter(server.endpoint, 0, 1, FINGERPRINTS[0], lambda key: None)
    client = LookupClient(server.endpoint, 2000)
    try:
        assert reporter.flush()
        assert wait_for(client, [A, B], ["shared"])
    finally:
        client.close()
        reporter.close()
        server.close()
