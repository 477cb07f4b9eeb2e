"""``kvtier-bench pd-soak``'s verdict, table, JSON and plot (see :mod:`kvtier.bench.pd_soak`).

A request was in flight during a kill when it started before the killed server answered
/health again and ended after the kill: its failure is *failed (peer killed)*, anything else
that failed is *failed (other)*. The negative control takes the first correct answer and checks
it with the very checker the soak uses against another prompt's recompute: it must be flagged
wrong, or the soak's own check proves nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.bench.common import NO_MATPLOTLIB, make_parent, pyplot, save_figure
from kvtier.bench.pd_soak_plan import check_answer

KiB = 1 << 10
ENGINE_FAULTS = {"corrupt": "corrupted chunk (engine hook)", "delay_read": "delayed READ (engine hook)"}


@dataclass
class Criterion:
    """One pass criterion: met or not, and the numbers that decided it."""

    name: str
    ok: bool
    detail: str


def _killed_during(outcome, kill) -> bool:
    ready = kill.ready_s if kill.ready_s is not None else float("inf")
    return outcome.start_s < ready and outcome.end_s >= kill.at_s


def negative_control(outcomes, references: dict[int, list[int]]) -> dict:
    """The first correct answer checked against a reference it does not equal: ``flagged`` is
    True when :func:`check_answer` calls it wrong (``None`` fields: nothing to compare)."""
    for a in outcomes:
        if a.status != "ok":
            continue
        other = next((i for i, ref in references.items() if ref != references[a.index]), None)
        if other is None:
            break
        return {"answer_of": a.index, "reference_of": other,
                "flagged": check_answer(a.tokens, references[other]) == "wrong"}
    return {"answer_of": None, "reference_of": None, "flagged": False}


def evaluate(settings: dict, plan, references, outcomes, fleet, idle, with_restarts: bool) -> dict:
    for o in outcomes:
        o.peer_killed = any(_killed_during(o, k) for k in fleet.kills)
    status = Counter(o.status for o in outcomes)
    failed_other = [o for o in outcomes if o.status == "failed" and not o.peer_killed]
    control = negative_control(outcomes, references)
    rows = _rows(outcomes, fleet)
    unrecovered = [k for k in fleet.kills if k.ready_s is None or not any(
        o.status == "ok" and o.start_s >= k.ready_s for o in outcomes)]
    distinct = len({tuple(r) for r in references.values()})
    held = {"p_held_hbm_bytes": idle.p_held_hbm, "p_kv_usage": idle.p_kv, "d_kv_usage": idle.d_kv,
            "p_running": idle.p_running, "d_running": idle.d_running}
    criteria = [
        Criterion("0 wrong answers", status["wrong"] == 0 and status["ok"] > 0,
                  f"{status['wrong']} wrong of {status['ok'] + status['wrong']} answered with HTTP 200"),
        Criterion("0 hung", status["hung"] == 0, f"{status['hung']} requests without an answer within "
                  f"{settings['client_timeout_s']:.1f} s (pd_timeout_ms + 1 s)"),
        Criterion("0 failures outside kills", not failed_other,
                  f"{len(failed_other)} failed while no server was down" +
                  (f" (first: request {failed_other[0].index}: {failed_other[0].error})" if failed_other else "")),
        Criterion("recovered after every kill", with_restarts and not unrecovered,
                  f"{len(fleet.kills) - len(unrecovered)} of {len(fleet.kills)} kills followed by a correct answer "
                  "from the restarted server"),
        Criterion("0 bytes held once idle", idle.p_held_hbm == 0 and idle.d_kv == 0 and idle.p_kv == 0,
                  f"P holds {_n(idle.p_held_hbm)} B under leases" +
                  (" (series not exported)" if idle.p_held_hbm is None and idle.p_kv is not None else "") +
                  f"; KV in use: P {_pct(idle.p_kv)}, D {_pct(idle.d_kv)}"),
        Criterion("the checker flags a wrong answer", control["flagged"],
                  f"request {control['answer_of']}'s answer against request {control['reference_of']}'s reference: "
                  f"{'flagged wrong' if control['flagged'] else 'NOT flagged'}; {distinct} distinct reference answers "
                  f"of {len(references)}"),
    ]
    return {"benchmark": "pd-soak", "settings": settings, "planned": len(plan), "sent": len(outcomes),
            "status": dict(status), "failed_peer_killed": sum(o.status == "failed" and o.peer_killed for o in outcomes),
            "failed_other": len(failed_other), "rows": rows, "held": held, "negative_control": control,
            "distinct_references": distinct, "criteria": criteria, "ok": all(c.ok for c in criteria),
            "outcomes": [asdict(o) | {"tokens": None} for o in outcomes], **fleet.as_json()}


def _rows(outcomes, fleet) -> list[dict]:
    """One row per fault kind: injected, refused, failed (peer killed / other), wrong, hung, note."""

    def row(name: str, injected, group, refused="-", note: str = "") -> dict:
        return {"fault": name, "injected": injected, "refused": refused,
                "failed_peer_killed": sum(o.status == "failed" and o.peer_killed for o in group),
                "failed_other": sum(o.status == "failed" and not o.peer_killed for o in group),
                "wrong": sum(o.status == "wrong" for o in group), "hung": sum(o.status == "hung" for o in group),
                "note": note}

    of = lambda kind: [o for o in outcomes if o.kind == kind]  # noqa: E731
    races = of("lease_race")
    expired = sum(o.expired is True for o in races)
    rows = [row("none (through the proxy)", len(of("none")), of("none")),
            row("lease race (D's leg held back)", len(races), races,
                note=f"{expired} of {len(races)} D legs sent after the lease ended")]
    replays = [o for o in of("replay") if o.forged]
    for key, name in (("release", "forged Release of a transfer in flight"), ("hello_replay", "replayed Hello")):
        got = Counter(o.forged.get(key) for o in replays)
        rows.append(row(name, len(replays), replays, got["refused"],
                        f"answered {got['answered']}, silent {got['silent']}, unreadable {got['unreadable']}"))
    for role, name in (("p", "P killed"), ("d", "D killed")):
        kills = [k for k in fleet.kills if k.role == role]
        group = [o for o in outcomes if any(_killed_during(o, k) for k in kills)]
        back = [f"{k.ready_s - k.at_s:.0f}" for k in kills if k.ready_s is not None]
        rows.append(row(name, len(kills), group, note=f"{len(group)} requests in flight; back after "
                        f"{', '.join(back) or '-'} s"))
    for fault, counts in fleet.fault_lines().items():
        active = counts["hooks_in_use"] > 0
        rows.append(row(ENGINE_FAULTS[fault], counts["injected"] if active else "-", [],
                        note=f"hook called in {counts['hooks_in_use']} engine processes" if active
                        else "fault not active (hook not wired into the P/D code)"))
    return rows


def _n(value) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def format_report(result: dict) -> str:
    st, status = result["settings"], result["status"]
    head = (f"kvtier-bench pd-soak: {result['sent']} of {result['planned']} requests sent, seed {st['seed']}, "
            f"{st['pd_transport']}, lease {st['lease_ms']} ms, pd_timeout_ms {st['pd_timeout_ms']}, "
            f"{st['concurrency']} clients; engine faults {st['engine_faults'] or 'off'}")
    cols = ("injected", "refused", "failed_peer_killed", "failed_other", "wrong", "hung")
    titles = ("injected", "refused", "failed (killed)", "failed (other)", "wrong", "hung")
    width = max(len(r["fault"]) for r in result["rows"])
    lines = [head, "", f"{'fault':{width}}  " + "  ".join(f"{t:>15}" for t in titles) + "  note"]
    for r in result["rows"]:
        lines.append(f"{r['fault']:{width}}  " + "  ".join(f"{r[c]!s:>15}" for c in cols) + f"  {r['note']}")
    held, totals = result["held"], result["d_totals"]
    lines += ["", f"requests: {result['sent']}; ok {status.get('ok', 0)}, wrong {status.get('wrong', 0)}, "
              f"hung {status.get('hung', 0)}, failed {status.get('failed', 0)} "
              f"({result['failed_peer_killed']} peer killed, {result['failed_other']} other)",
              f"held once idle: P {_n(held['p_held_hbm_bytes'])} B of engine blocks under leases "
              f"(vllm:kvtier_held_bytes{{tier=\"hbm\"}}); KV cache in use: P {_pct(held['p_kv_usage'])}, "
              f"D {_pct(held['d_kv_usage'])}",
              f"D over all its lives: {_n(totals['d_external'])} prompt tokens loaded from P, "
              f"{_n(totals['d_landed'] / KiB)} KiB of them landed HBM to HBM, {_n(totals['d_failed'])} loads ended "
              "early and were recomputed", "", "pass criteria:"]
    lines += [f"  [{'ok' if c.ok else 'MISSED'}] {c.name}: {c.detail}" for c in result["criteria"]]
    return "\n".join(lines + ["", f"pd-soak {'PASS' if result['ok'] else 'FAIL'}"])


def write_json(result: dict, path: str) -> None:
    make_parent(path)
    Path(path).write_text(json.dumps(dict(result, criteria=[asdict(c) for c in result["criteria"]]), indent=1))


def write_plot(result: dict, path: str) -> str | None:
    """Three panels: each request's latency over time (by fault, wrong and failed marked, kills
    shaded), P's held bytes and both engines' KV usage over time, and per fault what struck and
    what failed. Returns None, or why the plot was skipped."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 10))
    marks = {"ok": "o", "wrong": "X", "failed": "v", "hung": "s"}
    for kind in sorted({o["kind"] for o in result["outcomes"]}):
        for st, marker in marks.items():
            group = [o for o in result["outcomes"] if o["kind"] == kind and o["status"] == st]
            if group:
                ax1.scatter([o["start_s"] for o in group], [1e3 * (o["end_s"] - o["start_s"]) for o in group],
                            marker=marker, s=14 if st == "ok" else 40, label=f"{kind} {st}")
    for k in result["kills"]:
        end = k["ready_s"] if k["ready_s"] is not None else k["at_s"]
        for ax in (ax1, ax2):
            ax.axvspan(k["at_s"], end, color="red" if k["role"] == "p" else "orange", alpha=0.15)
    ax1.set_yscale("log")
    ax1.set_title("request latency, ms (shaded: P killed red, D killed orange, until back)", fontsize=9)
    ax1.legend(fontsize=6, ncol=4)
    t = [s["t_s"] for s in result["samples"]]
    ax2.plot(t, [(s["p_held_hbm"] or 0) / KiB for s in result["samples"]], label="P held under leases, KiB")
    ax2b = ax2.twinx()
    ax2b.plot(t, [100 * (s["p_kv"] or 0) for s in result["samples"]], color="green", label="P KV in use, %")
    ax2b.plot(t, [100 * (s["d_kv"] or 0) for s in result["samples"]], color="purple", label="D KV in use, %")
    ax2.set_title("P's engine blocks under leases (KiB) and KV cache in use (%)", fontsize=9)
    ax2.set_xlabel("s")
    ax2.legend(fontsize=7, loc="upper left")
    ax2b.legend(fontsize=7, loc="upper right")
    rows = result["rows"]
    x = range(len(rows))
    injected = [r["injected"] if isinstance(r["injected"], int) else 0 for r in rows]
    failed = [r["failed_peer_killed"] + r["failed_other"] for r in rows]
    ax3.bar([i - 0.2 for i in x], injected, width=0.4, label="injected")
    ax3.bar([i + 0.2 for i in x], failed, width=0.4, label="failed")
    ax3.scatter([i for i in x if rows[i]["wrong"]], [rows[i]["wrong"] for i in x if rows[i]["wrong"]], color="red",
                marker="X", label="wrong", zorder=3)
    ax3.set_xticks(list(x))
    ax3.set_xticklabels([r["fault"] for r in rows], rotation=20, ha="right", fontsize=7)
    ax3.set_yscale("symlog")
    ax3.legend(fontsize=7)
    fig.suptitle(f"kvtier-bench pd-soak: {result['sent']} requests, {'PASS' if result['ok'] else 'FAIL'}", fontsize=10)
    save_figure(fig, path, dpi=110)
    return None
