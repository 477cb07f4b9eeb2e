"""kvtier.timeline: marks at DEBUG only, read back across processes, stages and the CLI; the load
thread's marks (a real TierWorker); the scheduler half's marks are checked in
tests/engines/test_timeline_marks.py."""

from __future__ import annotations

import logging

from kvtier import timeline
from kvtier.jobs import LoadJob
from kvtier.transfer import TierWorker

from test_transfer import CHUNK_BLOCKS, engine_kv, keys, save_job, stores  # noqa: F401  (fixture)


def _lines(records) -> list[str]:
    return [r.getMessage() for r in records if r.name == "kvtier.timeline"]


def test_marks_are_written_only_at_debug(caplog):
    caplog.set_level(logging.INFO, logger="kvtier")
    timeline.mark("r", "arrived")
    assert _lines(caplog.records) == []
    caplog.set_level(logging.DEBUG, logger="kvtier")
    timeline.mark("r", "arrived", "t-1")
    (line,) = _lines(caplog.records)
    assert line.startswith("kvtier timeline: r arrived ") and line.endswith(" transfer t-1")


def test_stages_join_ranks_and_the_producer_by_transfer():
    lines = [
        "DEBUG 11-27 00:00:00 kvtier timeline: p-1 finished 100.000 transfer t-1",  # P's log
        "DEBUG kvtier timeline: d-1 arrived 100.010 transfer t-1",  # D's scheduler
        "DEBUG kvtier timeline: d-1 looked up 100.011",
        "DEBUG kvtier timeline: d-1 looked up 100.0115",  # looked up again (waiting for blocks): the first counts
        "DEBUG kvtier timeline: d-1 planned 100.012",
        "DEBUG kvtier timeline: d-1 load began 100.015",  # rank 0
        "DEBUG kvtier timeline: d-1 load began 100.016",  # rank 1: the later one counts
        "DEBUG kvtier timeline: d-1 load ended 100.050",
        "DEBUG kvtier timeline: d-1 load ended 100.060",
        "DEBUG kvtier timeline: t-1 written 100.030",  # P's WRITEs (push), under the transfer id
        "DEBUG kvtier timeline: t-1 written 100.040",  # the last counts
        "DEBUG kvtier timeline: t-1 lent 100.020",  # P's replies naming its blocks (READ), the last counts
        "DEBUG kvtier timeline: t-1 lent 100.025",
        "DEBUG kvtier timeline: d-1 load reported 100.070",
        "DEBUG kvtier timeline: d-1 load seen 100.071",
        "DEBUG kvtier timeline: d-1 finished 100.090",  # D's step after the load
        "DEBUG kvtier timeline: h-1 arrived 200.000",  # a local hit: looked up, nothing loaded
        "DEBUG kvtier timeline: h-1 looked up 200.003",
        "INFO something else entirely",
    ]
    marks, transfers = timeline.read(lines)
    assert transfers == {"t-1": {"finished": 100.0, "arrived": 100.01}} and marks["d-1"]["transfer"] == "t-1"
    got = {stage: round(ms, 1) for stage, ms, _ in timeline.stages(marks, transfers)}
    assert got == {"producer finished -> consumer arrived": 10.0, "arrived -> looked up": 2.0,
                   "looked up -> planned": 1.0,
                   "planned -> load began": 4.0, "load began -> load ended": 44.0,
                   "load ended -> load reported": 10.0, "load reported -> load seen": 1.0,
                   "load seen -> finished": 19.0,
                   "arrived -> load seen": 61.0, "producer finished -> load seen": 71.0,
                   "producer finished -> last WRITE done": 40.0, "last WRITE done -> load ended": 20.0,
                   "producer finished -> last blocks lent": 25.0, "last blocks lent -> load ended": 35.0}


def test_the_command_prints_a_table_or_says_what_is_missing(tmp_path, capsys):
    log = tmp_path / "d.log"
    log.write_text("kvtier timeline: r arrived 1.000\nkvtier timeline: r planned 1.003\n")
    assert timeline.main([str(log)]) == 0
    assert "arrived -> planned" in capsys.readouterr().out
    log.write_text("nothing\n")
    assert timeline.main([str(log)]) == 1
    assert "KVTIER_LOG_LEVEL=DEBUG" in capsys.readouterr().out


def test_a_load_thread_marks_its_job_in_order(stores, caplog):  # noqa: F811
    caplog.set_level(logging.DEBUG, logger="kvtier")
    _, layout = engine_kv()
    worker = TierWorker(layout, stores(), CHUNK_BLOCKS)
    ks = keys(2)
    try:
        worker.save([save_job(ks)])
        worker.drain()
        worker.submit_load(LoadJob("r", tuple(ks), 0, tuple(range(40, 44)))).result(timeout=5)
        assert worker.take_finished() == ({"r"}, set())
    finally:
        worker.close()
    marks, _ = timeline.read(_lines(caplog.records))
    assert list(marks["r"]) == ["load began", "load ended", "load reported"]
    assert marks["r"]["load began"] <= marks["r"]["load ended"] <= marks["r"]["load reported"]
