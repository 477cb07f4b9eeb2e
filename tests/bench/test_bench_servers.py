"""How benches and tests start engines: ``start_group`` leads a new process group in this session
(one CPU scheduling group with the engines beside it, see its docstring), and ``stop_group`` ends
the whole group, children included."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvtier.bench.servers import start_group, stop_group

# Prints its session and group, starts a child that sleeps, prints the child's pid, then waits.
_PARENT = ("import os, subprocess, sys, time; "
           "print(os.getsid(0), os.getpgid(0), flush=True); "
           "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
           "print(c.pid, flush=True); time.sleep(60)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_engine_shares_this_session_and_leads_its_own_group_which_stop_group_ends():
    proc = start_group([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    try:
        sid, pgid = map(int, proc.stdout.readline().split())
        child = int(proc.stdout.readline())
        assert sid == os.getsid(0)  # not a session of its own: the kernel's autogroup keeps it with us
        assert pgid == proc.pid != os.getpgid(0)  # its own group: ended as one
        assert os.getpgid(child) == proc.pid
    finally:
        stop_group(proc, grace_s=5)
    assert proc.returncode is not None
    deadline = time.monotonic() + 10  # SIGKILL was sent to the group; the child dies (and is reaped) at once
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(child)
