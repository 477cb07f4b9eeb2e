"""Leases of a producer's engine blocks (kvtier.pd.producer.leases) and the descriptors of a block-to-block
READ (kvtier.pd.hbm): pure logic, a fake clock."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.pd.hbm import RegionSpan, block_runs, read_descriptors, registration
from kvtier.pd.producer.leases import BlockLeases

KEYS = (b"a" * 16, b"b" * 16, b"c" * 16)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def leases(clock: Clock, grace_s: float = 5.0) -> BlockLeases:
    return BlockLeases(chunk_blocks=2, block_bytes=1000, grace_s=grace_s, clock=clock)


def test_a_lease_hands_out_each_chunks_blocks_by_key():
    clock = Clock()
    lease = leases(clock)
    lease.lend("t", "r", (7, 8, 9, 10, 11), KEYS, 2.0)
    assert lease.blocks("t", KEYS[0], 2) == (7, 8)
    assert lease.blocks("t", KEYS[2], 1) == (11,)  # the prompt's partial tail
    assert lease.blocks("t", KEYS[2], 2) is None  # more blocks than the request has
    assert lease.blocks("t", b"x" * 16, 2) is None  # not this request's chunk
    assert lease.blocks("other", KEYS[0], 2) is None
    assert lease.held_bytes == 5000


def test_a_transfer_is_held_from_its_lease_until_the_lease_ends_or_is_released():
    clock = Clock()
    lease = leases(clock)
    lease.live("t", "r", (1, 2), KEYS[:1])
    assert not lease.holds("t")  # the running request's blocks: its chunks come as they are computed
    lease.lend("t", "r", (1, 2), KEYS[:1], 2.0)
    assert lease.holds("t") and not lease.holds("other")
    clock.now = 2.0
    assert not lease.holds("t")  # its time is up
    lease.lend("u", "s", (3, 4), KEYS[1:2], 2.0)
    lease.release("u")
    assert not lease.holds("u")


def test_an_unread_lease_ends_on_time_and_its_request_is_reported_once():
    clock = Clock()
    lease = leases(clock)
    lease.lend("t", "r", (1, 2), KEYS[:1], 2.0)
    clock.now = 1.9
    assert lease.take_ended() == set()
    clock.now = 2.0
    assert lease.blocks("t", KEYS[0], 2) is None  # never handed out past the lease
    assert lease.take_ended() == {"r"}
    assert lease.take_ended() == set()
    assert lease.held_bytes == 0 and lease.stats.expired == 1


def test_a_lease_handed_out_waits_for_the_release_then_ends():
    clock = Clock()
    lease = leases(clock)
    lease.lend("t", "r", (1, 2), KEYS[:1], 2.0)
    assert lease.blocks("t", KEYS[0], 2) == (1, 2)
    clock.now = 3.0  # past the lease, inside the grace: a READ may still be running
    assert lease.take_ended() == set()
    lease.release("t")
    assert lease.take_ended() == {"r"} and lease.stats.released == 1


def test_an_idle_step_waits_for_a_release_while_leases_run_and_not_otherwise():
    """vLLM steps on while a finished request's blocks are held: such a step waits (the chunk
    server's thread gets the interpreter), and a release wakes it at once."""
    lease = leases(Clock())
    start = time.monotonic()
    lease.wait_ended(5.0)
    assert time.monotonic() - start < 1.0  # no lease: no wait
    lease.lend("t", "r", (1, 2), KEYS[:1], 2.0)
    start = time.monotonic()
    lease.wait_ended(0.05)
    assert time.monotonic() - start >= 0.04  # a lease, nothing released: the whole wait
    threading.Timer(0.05, lease.release, args=("t",)).start()
    start = time.monotonic()
    lease.wait_ended(10.0)
    assert time.monotonic() - start < 5.0  # woken by the release
    start = time.monotonic()
    lease.lend("t2", "r2", (3, 4), KEYS[:1], 2.0)
    lease.wait_ended(5.0)
    assert time.monotonic() - start < 1.0  # an ended lease not taken yet: no wait
    assert lease.take_ended() == {"r"}


def test_a_consumer_that_never_releases_frees_nothing_past_lease_plus_grace():
    clock = Clock()
    lease = leases(clock, grace_s=5.0)
    lease.lend("t", "r", (1, 2), KEYS[:1], 2.0)
    lease.blocks("t", KEYS[0], 2)
    clock.now = 6.9
    assert lease.take_ended() == set()
    clock.now = 7.0
    assert lease.take_ended() == {"r"}
    assert lease.held_bytes == 0 and lease.stats.abandoned == 1


def test_an_expected_lease_is_forgotten_when_its_request_finishes_without_one():
    clock = Clock()
    lease = leases(clock)
    lease.expect("t", "r")
    assert lease.expected("t")
    lease.finished({"r"})
    assert not lease.expected("t")
    lease.expect("t2", "r2")
    lease.lend("t2", "r2", (1, 2), KEYS[:1], 1.0)
    assert not lease.expected("t2")


def test_a_second_lease_under_one_transfer_id_ends_the_first():
    clock = Clock()
    lease = leases(clock)
    lease.lend("t", "r1", (1, 2), KEYS[:1], 2.0)
    lease.lend("t", "r2", (3, 4), KEYS[:1], 2.0)
    assert lease.take_ended() == {"r1"}
    assert lease.blocks("t", KEYS[0], 2) == (3, 4)
    assert lease.end_all() == {"r2"}


def test_a_running_request_aborted_or_preempted_hands_out_none_of_its_blocks():
    """Regression: its blocks go back to vLLM at once, so a D asking from then on must not be given
    them (they may hold another request's KV by the time it READs or is written into)."""
    clock = Clock()
    lease = leases(clock)
    lease.live("t", "r", (7, 8, 9, 10), KEYS[:2])
    lease.expect("t", "r")
    assert lease.blocks("t", KEYS[0], 2) == (7, 8)
    lease.stopped(("t",))
    assert lease.blocks("t", KEYS[0], 2) is None and lease.blocks("t", KEYS[1], 2) is None
    assert not lease.expected("t")
    lease.live("t", "r", (20, 21), KEYS[:1])  # computed again after the preemption: its new blocks
    assert lease.blocks("t", KEYS[0], 2) == (20, 21)


def test_block_runs_pair_consecutive_blocks_on_both_sides():
    assert block_runs([4, 5, 6, 9], [10, 11, 12, 13]) == [(4, 10, 3), (9, 13, 1)]
    assert block_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    with pytest.raises(ValueError):
        block_runs([1], [1, 2])


def test_dense_regions_take_one_descriptor_per_run_and_region():
    mine = (RegionSpan(10_000, 100, 100), RegionSpan(50_000, 100, 100))
    theirs = (RegionSpan(90_000, 100, 100), RegionSpan(70_000, 100, 100))
    local, remote = read_descriptors(mine, theirs, [0, 1, 2, 3], [5, 6, 7, 8])
    assert local == [(10_000, 400), (50_000, 400)]
    assert remote == [(90_500, 400), (70_500, 400)]


def test_strided_regions_take_one_descriptor_per_block_and_sizes_pair_up():
    mine = (RegionSpan(0, 300, 100),)
    theirs = (RegionSpan(1_000_000, 100, 100),)
    local, remote = read_descriptors(mine, theirs, [2, 3], [0, 1])
    assert local == [(600, 100), (900, 100)] and remote == [(1_000_000, 100), (1_000_100, 100)]
    assert [n for _, n in local] == [n for _, n in remote]


def test_regions_of_other_sizes_are_refused():
    with pytest.raises(ValueError, match="differ"):
        read_descriptors((RegionSpan(0, 100, 100),), (RegionSpan(0, 200, 200),), [0], [0])


def test_registration_merges_interleaved_regions_of_one_allocation():
    # K and V of each block side by side (vLLM-CPU): two regions, one range
    spans = (RegionSpan(0, 200, 100), RegionSpan(100, 200, 100), RegionSpan(10_000, 100, 100))
    assert registration(spans, 4) == [(0, 800), (10_000, 400)]
