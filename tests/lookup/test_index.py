"""HoldIndex against a plain model of the commit rule, under random interleavings of reports."""

from hypothesis import given, settings, strategies as st

from kvtier.keys import storage_key
from kvtier.lookup import HoldIndex
from kvtier.lookup.protocol import VERSION, HoldReport

KEYS = [bytes([i]) * 16 for i in range(4)]
FINGERPRINTS = [bytes([0x80 + r]) * 16 for r in range(3)]

_event = st.tuples(st.integers(0, 2), st.integers(0, 3), st.sampled_from(["cpu", "disk", ""]))


def report(rank, world, changes):
    fp = FINGERPRINTS[rank]
    return HoldReport(VERSION, rank, world, fp, [storage_key(KEYS[k], fp) for k, _ in changes], [t for _, t in changes])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.lists(_event, max_size=40), st.permutations(range(4)))
def test_visible_exactly_while_every_rank_holds(world, events, order):
    index = HoldIndex(world)
    held = [dict() for _ in range(world)]  # the model: rank -> key index -> tier
    for rank, key, tier in events:
        rank %= world
        assert index.apply(report(rank, world, [(key, tier)])) is None
        if tier:
            held[rank][key] = tier
        else:
            held[rank].pop(key, None)
    expected = []
    for key in order:
        if any(key not in h for h in held):
            break
        expected.append("disk" if any(h[key] == "disk" for h in held) else "cpu")
    reported = {rank % world for rank, _, _ in events}
    if len(reported) < world:
        expected = []  # a rank that never reported holds nothing
    assert index.prefix_tiers([KEYS[k] for k in order]) == expected


def test_a_rank_with_a_new_layout_starts_from_nothing():
    index = HoldIndex(1)
    index.apply(report(0, 1, [(0, "cpu")]))
    assert index.prefix_tiers([KEYS[0]]) == ["cpu"]
    fresh = HoldReport(VERSION, 0, 1, b"\x01" * 16, [], [])
    assert index.apply(fresh) is None
    assert index.held_count(0) == 0 and index.prefix_tiers([KEYS[0]]) == []


def test_bad_reports_change_nothing():
    index = HoldIndex(2)
    assert "world size" in index.apply(report(0, 3, [(0, "cpu")]))
    assert "outside" in index.apply(HoldReport(VERSION, 2, 2, FINGERPRINTS[0], [], []))
    assert "tiers" in index.apply(HoldReport(VERSION, 0, 2, FINGERPRINTS[0], [KEYS[0]], []))
    assert index.held_count(0) == 0
