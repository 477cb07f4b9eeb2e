"""The scheduler half's timeline marks (kvtier.timeline) inside the real vLLM scheduler: a reload
marks its arrival, its plan and the moment the scheduler saw it loaded, in that order; a request
loading nothing is marked only as arrived, looked up and finished (see sched_harness)."""

from __future__ import annotations

import logging
import random

import pytest

pytest.importorskip("vllm")

from kvtier import timeline  # noqa: E402

from sched_harness import VOCAB, Harness  # noqa: E402

BS, CHUNK = 16, 64
P = [random.Random(1).randrange(3, VOCAB) for _ in range(4 * CHUNK + 8)]


def test_a_reload_is_marked_from_arrival_to_loaded(caplog):
    h = Harness(block_size=BS, chunk_tokens=CHUNK, num_blocks=64)
    try:
        first = h.add(P, 1)
        h.drain()
        h.sched.reset_prefix_cache()
        caplog.set_level(logging.DEBUG, logger="kvtier")
        second = h.add(P, 1)
        h.drain()
    finally:
        h.close()
    marks, _ = timeline.read(r.getMessage() for r in caplog.records if r.name == "kvtier.timeline")
    assert first not in marks
    assert list(marks[second]) == ["arrived", "looked up", "planned", "load seen", "finished"]
    times = list(marks[second].values())
    assert times == sorted(times)


def test_malformed_transfer_params_still_mark_the_arrival(caplog):
    """kv_transfer_params come from the client: a list there must not break admission."""
    h = Harness(block_size=BS, chunk_tokens=CHUNK, num_blocks=64)
    caplog.set_level(logging.DEBUG, logger="kvtier")
    try:
        req = h.add(P, 1)
        h.requests[req].kv_transfer_params = ["not", "a", "dict"]
        h.sched.connector.on_new_request(h.requests[req])
        h.drain()
    finally:
        h.close()
    marks, transfers = timeline.read(r.getMessage() for r in caplog.records if r.name == "kvtier.timeline")
    assert "arrived" in marks[req] and not transfers


def test_a_request_waiting_for_blocks_is_looked_up_each_step_but_marked_once(caplog):
    """vLLM asks the connector about the head of its queue every step it cannot allocate it; one
    log line each would cost the engine's thread (the benches log at DEBUG) for nothing."""
    h = Harness(block_size=BS, chunk_tokens=CHUNK, num_blocks=24)  # room for one prompt at a time
    caplog.set_level(logging.DEBUG, logger="kvtier")
    try:
        h.add(P, 8)
        h.step()
        waiting = h.add([random.Random(2).randrange(3, VOCAB) for _ in P], 1)
        for _ in range(4):
            h.step()
        asked = h.sched.connector.scheduler_side.lookups(waiting)
        h.drain()
    finally:
        h.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.timeline"]
    assert asked >= 3  # asked again while it waited
    assert sum(f" {waiting} looked up " in line for line in lines) == 1
