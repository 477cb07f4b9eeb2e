"""A P/D transfer's route and stages (:mod:`kvtier.pd.route`): the decision table, the view both
engines take of it, the steps a transfer may and may not take, and that no other module of
kvtier reads the mode settings the route is decided from."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from kvtier.pd import route as route_module
from kvtier.pd.protocol import VERSION, ChunkReply
from kvtier.pd.route import (
    HBM_WINDOW, LENT_WINDOW, PUSH_WINDOW, WINDOW, Course, IllegalTransition, PushMode, Route, Stage, decide_route,
    producer_route,
)

ROOT = Path(__file__).resolve().parents[2]
R = Route

# (nixl, hbm, push, push_mode) -> route: every row of the table
TABLE = {
    (False, hbm, push, mode): R.ZMQ for hbm, push, mode in itertools.product((False, True), (False, True), PushMode)
} | {
    (True, False, False, PushMode.READ): R.CPU_READ, (True, False, False, PushMode.WRITE): R.CPU_READ,
    (True, False, True, PushMode.READ): R.CPU_WRITE, (True, False, True, PushMode.WRITE): R.CPU_WRITE,
    (True, True, False, PushMode.READ): R.HBM_READ, (True, True, False, PushMode.WRITE): R.HBM_READ,
    (True, True, True, PushMode.READ): R.HBM_READ, (True, True, True, PushMode.WRITE): R.HBM_WRITE,
}


@pytest.mark.parametrize("facts", sorted(TABLE, key=str))
def test_the_route_follows_the_table(facts):
    nixl, hbm, push, mode = facts
    assert decide_route(nixl=nixl, hbm=hbm, push=push, push_mode=mode) is TABLE[facts]


@pytest.mark.parametrize("facts", sorted(TABLE, key=str))
def test_the_producer_sees_the_route_the_consumer_decided(facts):
    """D gives its NIXL metadata exactly where its route writes into it: P's view then agrees."""
    nixl, hbm, push, mode = facts
    mine = decide_route(nixl=nixl, hbm=hbm, push=push, push_mode=mode)
    assert producer_route(nixl=nixl, regions=hbm, writable=mine.writes) is mine


def test_an_emulated_hbm_path_keeps_the_direction_over_the_cpu_tiers():
    assert [r.over_cpu() for r in Route] == [R.ZMQ, R.CPU_READ, R.CPU_WRITE, R.CPU_READ, R.CPU_WRITE]
    assert [r for r in Route if r.writes] == [R.CPU_WRITE, R.HBM_WRITE]
    assert [r for r in Route if r.hbm] == [R.HBM_READ, R.HBM_WRITE]
    assert [r for r in Route if not r.nixl] == [R.ZMQ]


def ok(index: int, blocks: tuple[int, ...] = (), more: int = 0) -> ChunkReply:
    return ChunkReply(VERSION, index, "ok", blocks=blocks, more=more)


def test_a_pull_lent_hbm_to_hbm_asks_for_everything_at_once():
    course = Course("t1", "tcp://p:1", push=False, landing=True)
    assert not course.answered(nixl=True, regions=True)
    assert course.stage is Stage.HANDSHAKEN and course.route is R.HBM_READ
    assert course.judged(direct=True, lending=True) is R.HBM_READ
    assert course.asks_rest() and course.window() == LENT_WINDOW
    course.posted()
    course.replied(ok(0, more=3))
    assert course.waits_for_turn()
    course.replied(ok(1))  # from the CPU tier: P lends no blocks for it
    assert not course.asks_rest() and course.window() == HBM_WINDOW
    course.landed()
    assert course.released(named=False) is False and course.stage is Stage.RELEASED


def test_a_push_written_into_says_so_in_a_second_hello_then_waits_for_the_producers_word():
    course = Course("t1", "tcp://p:1", push=True, push_mode=PushMode.WRITE, landing=True)
    assert course.answered(nixl=True, regions=True)  # send the metadata first
    assert course.stage is Stage.ARRIVED and course.writable
    assert not course.answered(nixl=True, regions=True)
    assert course.route is R.HBM_WRITE and course.window() == PUSH_WINDOW
    assert course.judged(direct=False, lending=False) is R.CPU_WRITE and course.window() == WINDOW
    course.posted()
    course.failed()
    assert course.released(named=True)  # P may still WRITE: wait for its word
    silent = Course("t2", "tcp://p:1", push=True, push_mode=PushMode.WRITE)
    silent.answered(nixl=True, regions=False)
    silent.answered(nixl=True, regions=False)
    silent.went_silent()
    silent.failed()
    assert silent.route is R.CPU_WRITE and not silent.released(named=True)  # a silent producer is gone


@pytest.mark.parametrize("steps", [
    ("posted",), ("landed",), ("released",), ("answered", "answered"), ("answered", "landed", "posted"),
    ("answered", "posted", "landed", "failed"), ("answered", "posted", "failed", "landed"),
    ("answered", "posted", "failed", "released", "released"), ("answered", "replied"),
])
def test_an_illegal_step_is_refused_naming_the_transfer(steps):
    course = Course("t9", "tcp://p:1", push=False)
    calls = {"answered": lambda: course.answered(nixl=False, regions=False), "posted": course.posted,
             "landed": course.landed, "failed": course.failed, "released": lambda: course.released(False),
             "replied": lambda: course.replied(ok(0))}
    for step in steps[:-1]:
        calls[step]()
    with pytest.raises(IllegalTransition, match="transfer t9 from tcp://p:1 cannot go from"):
        calls[steps[-1]]()


# ---- no module but route.py reads the P/D mode settings -------------------------------------------

MODE_NAMES = {"pd_hbm_push", "push_mode", "landing_enabled", "lends_now", "writable"}  # settings, flags of old and new
ALLOWED_FILES = {"kvtier/pd/route.py", "kvtier/config.py"}  # the state machine; the settings themselves
ROUTE_NAMES = {n for n, v in vars(route_module).items() if getattr(v, "__module__", "") == route_module.__name__}


def mode_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of each read of a mode setting or flag in ``source`` that does not go straight
    into the route module (an argument of a call of one of its names, such as ``PushMode(...)``, or
    a dataclass field's default)."""
    tree = ast.parse(source)
    passed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            passed.add(id(node.value))
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if callee in ROUTE_NAMES:
                passed.update(id(a) for a in [*node.args, *(k.value for k in node.keywords)])
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in passed:
            continue
        if node.attr in MODE_NAMES or (isinstance(node.value, ast.Name) and node.value.id == "PushMode"):
            found.append((node.lineno, node.attr))
    return found


def test_the_scan_finds_a_mode_read_and_lets_the_wiring_pass():
    assert mode_reads("if config.pd_hbm_push == 'write':\n    pass\n") == [(1, "pd_hbm_push")]
    assert mode_reads("window = 256 if course.lends_now else 4\n") == [(1, "lends_now")]
    assert mode_reads("blocks = ids if mode is PushMode.WRITE else ()\n") == [(1, "WRITE")]
    assert mode_reads("mode = PushMode(config.pd_hbm_push)\nc = Course(t, e, w, consumer.push_mode)\n") == []
    assert mode_reads("class Consumer:\n    push_mode: PushMode = PushMode.READ\n") == []


def test_no_module_but_the_route_reads_a_p_d_mode():
    found = [f"{path.relative_to(ROOT)}:{line}: {name}"
             for path in sorted((ROOT / "kvtier").rglob("*.py")) if str(path.relative_to(ROOT)) not in ALLOWED_FILES
             for line, name in mode_reads(path.read_text())]
    assert not found, ("P/D modes are decided in kvtier/pd/route.py only (pass the setting into one of its "
                       f"constructors, dispatch on the Route): {found}")
