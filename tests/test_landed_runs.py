"""Which plan checks the chunks that landed (:func:`kvtier.transfer.landed._built`): the one built
ahead for a transfer's chunks checks any run of them (a pull's all, a push's step), and nothing
else. The plans themselves need a GPU (``tests/ops/test_gpu_landed_check.py``); here a token
stands in for one."""

from __future__ import annotations

from concurrent.futures import Future

from kvtier.transfer.landed import _built

CHUNKS = tuple((2 * c, 2 * c + 1) for c in range(6))  # the engine blocks of each of six chunks


def built(chunks=CHUNKS, plan="plan") -> Future:
    done: Future = Future()
    done.set_result((chunks, plan))
    return done


def test_the_plan_built_ahead_checks_all_its_chunks_or_any_run_of_them():
    assert _built(built(), CHUNKS) == ("plan", 0)
    assert _built(built(), CHUNKS[2:5]) == ("plan", 2)
    assert _built(built(), CHUNKS[5:]) == ("plan", 5)


def test_chunks_it_was_not_built_for_get_a_plan_of_their_own():
    assert _built(built(CHUNKS[1:]), CHUNKS[:3]) is None  # chunk 0 was not among them
    assert _built(built(), (CHUNKS[1], CHUNKS[3])) is None  # not a run
    assert _built(built(), CHUNKS[4:] + ((20, 21),)) is None  # runs past its end
    assert _built(None, CHUNKS) is None and _built(built(), ()) is None


def test_a_plan_that_failed_to_build_is_built_again():
    failed: Future = Future()
    failed.set_exception(RuntimeError("no room"))
    assert _built(failed, CHUNKS) is None
