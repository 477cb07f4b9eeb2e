"""Where a load's time goes: wall-clock marks of a request's way through kvtier, one DEBUG line
each, joined afterwards across processes (the scheduler, each worker, a P/D producer).

A mark is ``kvtier timeline: <request> <event> <epoch s> [transfer <id>]``. The events, in order:

* ``arrived``: the scheduler first saw the request (a P/D consumer's names its transfer);
* ``looked up``: the scheduler's look-up of the prompt's chunks answered (every request, local
  hits included; a request waiting for blocks is looked up again each step, marked once);
* ``planned``: blocks were allocated for a load (the load job goes out with the next step);
* ``load began`` / ``load ended``: a worker's load thread ran the job (each TP rank marks its own);
* ``load reported``: the worker handed the finished load to vLLM;
* ``load seen``: the scheduler took it; the request runs in the next step;
* ``finished``: vLLM finished the request (a P/D producer's names its transfer: its prefill ended;
  with ``max_tokens=1``, as the benches ask, the step that follows the load gives the first token);
* ``written``: a P/D producer's chunk server saw a WRITE into the consumer end (push; marked
  under the transfer id, not a request: the last one counts);
* ``lent``: a P/D producer's chunk server sent replies naming its engine blocks for the consumer
  to READ (under the transfer id; the last one counts).

``python -m kvtier.timeline LOG ...`` reads the marks back from engine logs (``KVTIER_LOG_LEVEL=DEBUG``)
and prints, per stage, the median ms over the requests that passed through it; for P/D also the
hops from the producer's ``finished`` (joined by transfer id) to the consumer's ``arrived`` and
``load seen``, and to the producer's last ``written`` or ``lent``.
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import sys
import time
from collections import defaultdict

logger = logging.getLogger(__name__)

EVENTS = ("arrived", "looked up", "planned", "load began", "load ended", "load reported", "load seen", "finished")
_COPIES = {"written": "last WRITE done", "lent": "last blocks lent"}  # a producer's marks, per transfer
_NAMES = "|".join((*EVENTS, *_COPIES))
_MARK = re.compile(rf"kvtier timeline: (\S+) ({_NAMES}) ([0-9.]+)(?: transfer (\S+))?")


def mark(request_id: str, event: str, transfer_id: str | None = None) -> None:
    """Log ``event`` of ``request_id`` now (only at DEBUG: nothing is formatted otherwise)."""
    if logger.isEnabledFor(logging.DEBUG):
        if transfer_id:
            logger.debug("kvtier timeline: %s %s %.6f transfer %s", request_id, event, time.time(), transfer_id)
        else:
            logger.debug("kvtier timeline: %s %s %.6f", request_id, event, time.time())


def read(lines) -> tuple[dict[str, dict], dict[str, dict[str, float]]]:
    """From log ``lines``: request -> event -> epoch s (a worker event: the last rank's; a
    consumer's ``transfer``: the id it fetches), and transfer id -> {"finished": the producer's,
    "arrived": the consumer's} epoch s."""
    marks: dict[str, dict] = defaultdict(dict)
    transfers: dict[str, dict[str, float]] = defaultdict(dict)
    for line in lines:
        m = _MARK.search(line)
        if m is None:
            continue
        request, event, at, transfer = m.group(1), m.group(2), float(m.group(3)), m.group(4)
        mine = marks[request]
        last = event.startswith("load") or event in _COPIES
        mine[event] = max(mine.get(event, at), at) if last else mine.get(event, at)
        if transfer and event in ("finished", "arrived"):
            transfers[transfer].setdefault(event, at)
            if event == "arrived":
                mine["transfer"] = transfer
    return dict(marks), dict(transfers)


def stages(marks: dict[str, dict], transfers: dict[str, dict[str, float]]) -> list[tuple[str, float, int]]:
    """``(stage, median ms, requests)`` between each request's consecutive marks (a request marks
    what it passed through: a local hit no load), in order, and the P/D hops."""
    out = []
    hops = [t["arrived"] - t["finished"] for t in transfers.values() if {"arrived", "finished"} <= t.keys()]
    if hops:
        out.append(("producer finished -> consumer arrived", statistics.median(hops) * 1e3, len(hops)))
    gaps: dict[tuple[int, int], list[float]] = defaultdict(list)  # between each request's consecutive marks
    for m in marks.values():
        present = [i for i, event in enumerate(EVENTS) if event in m]
        for i, j in zip(present, present[1:]):
            gaps[i, j].append(m[EVENTS[j]] - m[EVENTS[i]])
    for (i, j), values in sorted(gaps.items()):
        out.append((f"{EVENTS[i]} -> {EVENTS[j]}", statistics.median(values) * 1e3, len(values)))
    whole = [m["load seen"] - m["arrived"] for m in marks.values() if {"arrived", "load seen"} <= m.keys()]
    if whole:
        out.append(("arrived -> load seen", statistics.median(whole) * 1e3, len(whole)))
    consumers = list(_consumers(marks, transfers))
    after = [m["load seen"] - transfers[t]["finished"] for t, m in consumers]
    if after:  # push: the consumer arrived first, so this is its wait beyond the prefill
        out.append(("producer finished -> load seen", statistics.median(after) * 1e3, len(after)))
    for event, name in _COPIES.items():
        copied = [(transfers[t]["finished"], marks[t][event], m["load ended"]) for t, m in consumers
                  if event in marks.get(t, {}) and "load ended" in m]
        if copied:
            out.append((f"producer finished -> {name}", statistics.median(c - f for f, c, _ in copied) * 1e3,
                        len(copied)))
            out.append((f"{name} -> load ended", statistics.median(e - c for _, c, e in copied) * 1e3, len(copied)))
    return out


def _consumers(marks: dict[str, dict], transfers: dict[str, dict[str, float]]):
    """``(transfer id, the consumer's marks)`` where the producer's finish is known too."""
    for m in marks.values():
        t = m.get("transfer")
        if t is not None and "finished" in transfers.get(t, {}) and "load seen" in m:
            yield t, m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Where kvtier's loads spent their time, from engine logs at DEBUG.")
    ap.add_argument("logs", nargs="+", help="engine log files (every process of a P/D pair or a TP engine)")
    args = ap.parse_args(argv)
    lines = []
    for path in args.logs:
        with open(path, errors="replace") as f:
            lines += f.readlines()
    rows = stages(*read(lines))
    if not rows:
        print("no kvtier timeline marks: run the engines with KVTIER_LOG_LEVEL=DEBUG")
        return 1
    print(f"{'stage':42} {'median ms':>9} {'requests':>8}")
    for stage, ms, n in rows:
        print(f"{stage:42} {ms:9.1f} {n:8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
