"""``kvtier-bench pd-engines --py-spy``'s recorder against a real process: py-spy samples a
running Python process from outside (here one with a thread named as a chunk server's, waiting),
stops on SIGINT and writes its speedscope file, which :func:`kvtier.bench.pd_spy.summary` reads.
Where the kernel forbids reading another process's memory (ptrace), py-spy says so and the
recorder reports it instead of a file."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvtier.bench.pd_spy import Spy, py_spy, summary

pytestmark = pytest.mark.skipif(py_spy() is None, reason="py-spy is not installed: make test installs it")

SERVING = """
import threading, time
def serve():
    while True:
        time.sleep(0.005)
threading.Thread(target=serve, name="kvtier-pd-server", daemon=True).start()
print("up", flush=True)
time.sleep(60)
"""


def test_a_recording_stops_on_request_and_is_summarized(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SERVING], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        spy = Spy(proc.pid, str(tmp_path / "p.speedscope.json"))
        time.sleep(1.0)
        problem = spy.stop()
        if problem is not None and "ermission" in problem:
            pytest.skip(f"this kernel does not let py-spy read another process: {problem}")
        assert problem is None and spy.seconds >= 1.0
        lines = summary(spy.path, spy.seconds)
        assert lines[0].startswith("2 threads, ~"), lines  # the main thread and the server's
        assert not any("remote loads" in line for line in lines)  # no load ran
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_is_gone_gives_a_reason_not_a_file(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    spy = Spy(proc.pid, str(tmp_path / "gone.speedscope.json"))
    problem = spy.stop()
    assert problem is not None and problem.startswith("py-spy wrote nothing"), problem
