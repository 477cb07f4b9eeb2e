"""``kvtier-bench pd-soak``: its plan and answer check on their own, and a CI-sized soak as a user
runs it (a subprocess: a reference server, P, D and kvtier-proxy, lease races, forged messages,
corrupted chunks and delayed READs), whose pass criteria must all hold.

CI sends ``REQUESTS`` = 30 requests and kills no server (each restart costs ~30 s of CI; a killed
P is in CI through ``tests/e2e/test_pd.py`` and ``tests/pd/test_pd_kill.py``);
``KVTIER_PD_SOAK_REQUESTS`` sets another count, with one kill of each server per 150 requests
(``KVTIER_PD_SOAK_REQUESTS=300``: two of each, about 4 minutes here). The soak's
own checker is tested against wrong answers twice: here on made-up outcomes (a wrong answer
fails the soak), and inside every run (a real answer checked against another prompt's recompute
must be flagged)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.bench.cli import build_parser
from kvtier.bench.pd_soak_client import Outcome
from kvtier.bench.pd_soak_fleet import Kill, Sample
from kvtier.bench.pd_soak_plan import KINDS, check_answer, make_plan
from kvtier.bench.pd_soak_report import evaluate, format_report, negative_control

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = int(os.environ.get("KVTIER_PD_SOAK_REQUESTS", "30"))
KILLS = REQUESTS // 150
# Three servers start at once (~80 s on a busy 2-core host), then each kill's restart ~30 s.
TIMEOUT_S = 600 + 2 * REQUESTS


def test_the_plan_is_the_seeds_and_places_kills_where_later_requests_show_recovery():
    plan = make_plan(200, seed=3, lease_ms=50, kills=2)
    assert plan == make_plan(200, seed=3, lease_ms=50, kills=2) != make_plan(200, seed=4, lease_ms=50, kills=2)
    kinds = [r.kind for r in plan]
    assert set(kinds) <= set(KINDS) and kinds.count("kill_p") == 2 and kinds.count("kill_d") == 2
    assert all(20 <= r.index < 160 for r in plan if r.kind.startswith("kill"))
    assert kinds.count("lease_race") > 20 and kinds.count("replay") > 5
    assert all(0.025 <= r.delay_s <= 0.075 for r in plan if r.kind == "lease_race")
    assert len({r.prompt for r in plan}) == len(plan)


def test_the_checker_flags_any_difference_from_the_recompute():
    assert check_answer([5, 6, 7], [5, 6, 7]) == "ok"
    assert check_answer([5, 6, 8], [5, 6, 7]) == "wrong"
    assert check_answer([5, 6], [5, 6, 7]) == "wrong"
    assert check_answer(None, [5, 6, 7]) == "wrong"


def _fleet(kills=(), held=0.0) -> SimpleNamespace:
    idle = Sample(9.0, held, 0.0, 0.0, 0.0, 0.0)
    return SimpleNamespace(kills=list(kills), fault_lines=lambda: {"corrupt": {"injected": 0, "hooks_in_use": 0},
                                                                   "delay_read": {"injected": 3, "hooks_in_use": 2}},
                           as_json=lambda: {"kills": [], "samples": [], "logs": {},
                                            "d_totals": {"d_landed": 0, "d_external": 0, "d_failed": 0}}), idle


def _evaluate(outcomes, references, kills=(), held=0.0) -> dict:
    settings = {"requests": len(outcomes), "seed": 0, "pd_transport": "nixl", "lease_ms": 50, "pd_timeout_ms": 3000,
                "concurrency": 1, "engine_faults": None, "client_timeout_s": 4.0}
    fleet, idle = _fleet(kills, held)
    return evaluate(settings, make_plan(len(outcomes), 0, 50, 0), references, outcomes, fleet, idle, True)


def test_a_wrong_answer_fails_the_soak_and_a_failure_during_a_kill_does_not():
    references = {0: [1, 2], 1: [3, 4], 2: [5, 6]}
    good = [Outcome(0, "none", 0.0, 1.0, "ok", 200, tokens=[1, 2]), Outcome(1, "none", 1.0, 2.0, "ok", 200, tokens=[3, 4]),
            Outcome(2, "kill_d", 2.0, 3.0, "failed", None, error="reset"),
            Outcome(3, "none", 6.0, 7.0, "ok", 200, tokens=[1, 2])]
    references[3] = [1, 2]
    result = _evaluate(good, references, kills=[Kill("d", 2.5, 5.0)])
    assert result["ok"], format_report(result)
    assert result["failed_peer_killed"] == 1 and result["failed_other"] == 0
    assert result["negative_control"] == {"answer_of": 0, "reference_of": 1, "flagged": True}
    report = format_report(result)
    assert "pd-soak PASS" in report and "fault not active" in report and "D killed" in report

    wrong = [Outcome(0, "none", 0.0, 1.0, "ok", 200, tokens=[1, 2]),
             Outcome(1, "lease_race", 1.0, 2.0, check_answer([1, 2], references[1]), 200, tokens=[1, 2])]
    result = _evaluate(wrong, references)
    assert not result["ok"] and "[MISSED] 0 wrong answers: 1 wrong of 2" in format_report(result)
    assert "pd-soak FAIL" in format_report(result)


def test_a_failure_with_every_server_up_a_hang_or_held_blocks_fail_the_soak():
    references = {0: [1, 2], 1: [3, 4]}
    ok = Outcome(0, "none", 0.0, 1.0, "ok", 200, tokens=[1, 2])
    for bad, missed in ((Outcome(1, "none", 1.0, 2.0, "failed", 502, error="HTTP 502"), "0 failures outside kills"),
                        (Outcome(1, "replay", 1.0, 5.0, "hung"), "0 hung")):
        assert f"[MISSED] {missed}" in format_report(_evaluate([ok, bad], references))
    held = _evaluate([ok, Outcome(1, "none", 1.0, 2.0, "ok", 200, tokens=[3, 4])], references, held=65536.0)
    assert "[MISSED] 0 bytes held once idle" in format_report(held)
    unexported = _evaluate([ok, Outcome(1, "none", 1.0, 2.0, "ok", 200, tokens=[3, 4])], references, held=None)
    assert "series not exported" in format_report(unexported) and not unexported["ok"]


def test_the_negative_control_needs_answers_that_depend_on_the_prompt():
    same = {0: [1, 2], 1: [1, 2]}
    assert negative_control([Outcome(0, "none", 0.0, 1.0, "ok", 200, tokens=[1, 2])], same)["flagged"] is False


def test_the_command_line():
    args = build_parser().parse_args(["pd-soak", "--requests", "40", "--seed", "7", "--pd-transport", "zmq",
                                      "--duration-s", "60", "--json", "x.json", "--plot", "x.png"])
    assert (args.requests, args.seed, args.pd_transport, args.duration_s, args.lease_ms) == (40, 7, "zmq", 60, 50)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["pd-soak", "--pd-transport", "tcp"])


@pytest.mark.e2e
def test_pd_soak_meets_every_pass_criterion(tmp_path):
    pytest.importorskip("vllm")
    from kvtier.pd.nixl import available

    transport = "nixl" if available() else "zmq"
    out, png = tmp_path / "pd-soak.json", tmp_path / "pd-soak.png"
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.bench.cli", "pd-soak", "--requests", str(REQUESTS),
                             "--kills", str(KILLS), "--pd-transport", transport, "--json", str(out), "--plot", str(png),
                             "--keep-logs", str(tmp_path / "logs")],
                            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the bench stops the servers it started
        stdout, stderr = proc.communicate(timeout=120)
        pytest.fail(f"kvtier-bench pd-soak took over {TIMEOUT_S} s:\n{stderr[-4000:]}")
    print(stdout)
    assert proc.returncode == 0, stdout + stderr[-4000:]
    assert "pd-soak PASS" in stdout
    data = json.loads(out.read_text())
    assert data["ok"] and all(c["ok"] for c in data["criteria"])
    assert data["sent"] == REQUESTS and data["status"].get("wrong", 0) == 0 and data["status"].get("hung", 0) == 0
    assert data["held"]["p_held_hbm_bytes"] == 0 and data["held"]["d_kv_usage"] == 0
    assert data["negative_control"]["flagged"] is True
    assert sorted(k["role"] for k in data["kills"]) == ["d"] * KILLS + ["p"] * KILLS
    assert all(k["ready_s"] is not None for k in data["kills"])
    rows = {r["fault"]: r for r in data["rows"]}
    assert rows["lease race (D's leg held back)"]["injected"] > 0 and rows["replayed Hello"]["injected"] > 0
    forged = (rows["replayed Hello"], rows["forged Release of a transfer in flight"])
    assert all(r["refused"] > 0 and r["note"].startswith("answered 0,") for r in forged), forged  # none obeyed
    assert data["d_totals"]["d_external"] > 0  # D loaded prompts from P, not only recomputed them
    assert png.stat().st_size > 0
