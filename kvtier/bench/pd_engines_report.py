"""``kvtier-bench pd-engines``'s outputs: its rows, the transport each row used (read from the
engines' logs), the rates, the plain-text table and the bar chart.

Times are milliseconds, rates GB/s (1e9 bytes per second). A row's figure per length is the median
of its repeats. See :mod:`kvtier.bench.pd_engines` for what each row measures; the result is the
dict :meth:`kvtier.bench.pd_engines_rows.Run.result` builds (also the ``--json`` file).

Transports: a kvtier decode engine (D) logs one line per producer and transport, ``kvtier P/D:
fetching from tcp://… over NIXL (HBM to HBM …)`` (P's engine blocks, READ into D's; the line may
add "else into this engine's CPU tier"), ``… over NIXL (UCX, into this engine's CPU tier)`` (P's
CPU-tier chunks) or ``… over ZMQ``; :func:`kvtier_paths` names the paths each offers and
:func:`row_transport` picks a row's. vLLM's NIXL connectors say nothing of theirs, so their
engines run with ``UCX_PROTO_INFO=y`` and UCX prints a table per endpoint and operation, e.g.::

    [1795704791.39] [vm:20143:1]   | b7d7eb6d-c48f-4b45-a649-6310683 intra-node cfg#1 |
    [1795704791.39] [vm:20143:1]   | remote memory write by ucp_put* from host memory to host |
    [1795704791.39] [vm:20143:1]   | Range  | Description |              Config               |
    [1795704791.39] [vm:20143:1]   | 0..inf | zero-copy   | cma/memory                        |

:func:`ucx_protocols` collects the UCX transports (``cuda_ipc``, ``rc_mlx5``, ``tcp``, ``cma``, …)
per endpoint kind and operation, and :func:`ucx_transport` names those of the remote-memory
operations between the engines (NIXL's READs and WRITEs; not an agent's loopback, ``self``).
"""

from __future__ import annotations

import re
import statistics

from kvtier.bench.common import NO_MATPLOTLIB, pyplot, save_figure
from kvtier.bench.pd_tp import recompute_note, recomputed, result_tp

ROWS = ("recompute", "local hit", "kvtier pull hbm", "kvtier pull after lease", "kvtier push nixl",
        "kvtier push nixl read", "kvtier push nixl write", "kvtier pull zmq", "kvtier push zmq",
        "NixlConnector pull", "NixlPushConnector push")
NIXL_HBM, NIXL_CPU, ZMQ = "NIXL HBM to HBM", "NIXL to CPU tier", "ZMQ"
# Which of D's transport lines a kvtier row is read from when none was logged during the row: a
# pull within P's lease READs P's engine blocks; a pull after the lease goes through the CPU
# tiers; a push has D READ P's engine blocks, or P WRITE into D's, as P computes them (or, where P
# keeps no blocks, into D's CPU tier).
EXPECTED = {"kvtier pull hbm": lambda t: "HBM" in t,
            "kvtier pull after lease": lambda t: t.startswith("NIXL") and "HBM" not in t,
            **{row: lambda t: t.startswith("NIXL") for row in ("kvtier push nixl", "kvtier push nixl read",
                                                              "kvtier push nixl write")},
            "kvtier pull zmq": lambda t: t == ZMQ, "kvtier push zmq": lambda t: t == ZMQ}
_UCX_CONTEXT = re.compile(r"\|\s*\S+\s+(self|intra-node|inter-node)\s+cfg#\d+")  # whose endpoint: self = loopback
_UCX_OP = re.compile(r"\|\s*([^|]*\bby ucp_[^|]*?)\s*\|")  # "remote memory read by ucp_get* from cuda memory"
_UCX_ROW = re.compile(r"\|\s*\d+[KMGT]?(?:\.\.(?:\d+[KMGT]?|inf))?\s*\|\s*[^|]+?\s*\|\s*([^|]+?)\s*\|")
_UCX_TL = re.compile(r"(?<![\w:/.-])([a-z][a-z0-9_]*)/")  # "rc_mlx5/mlx5_0:1" -> rc_mlx5


# ---- transports -----------------------------------------------------------------------------------
def kvtier_paths(line: str) -> list[str]:
    """The paths a kvtier D's transport line names: :data:`NIXL_HBM` and/or :data:`NIXL_CPU` (a
    line may offer both: HBM to HBM while P holds the blocks, else from its CPU tier), ``NIXL``,
    :data:`ZMQ`, else the words after "over"; ``["?"]`` for a line without them."""
    if " over " not in line:
        return ["?"]
    how = line.rsplit(" over ", 1)[1].strip().rstrip(".")
    if how.startswith("NIXL"):
        paths = [p for p, word in ((NIXL_HBM, "HBM"), (NIXL_CPU, "CPU tier")) if word in how]
        return paths or ["NIXL"]
    return [ZMQ] if how.startswith("ZMQ") else [how]


def row_transport(row: str, during: list[str], seen: list[str]) -> str:
    """A kvtier row's transport, from D's transport lines: the paths of those logged while the
    row's first request ran (``during``), else of those logged before it (``seen``: D logs one
    line per producer and transport, so a later row often logs none), that fit the row
    (:data:`EXPECTED`); "?" with what D logged when none fits."""
    paths = list(dict.fromkeys(p for line in (during or seen) for p in kvtier_paths(line)))
    fits = [p for p in paths if EXPECTED.get(row, lambda p: True)(p)]
    if fits:
        return " or ".join(fits)
    known = list(dict.fromkeys(p for line in seen + during for p in kvtier_paths(line)))
    return f"? (D logged: {', '.join(known)})" if known else "? (D logged no transport line)"


def ucx_protocols(text: str) -> dict[str, list[str]]:
    """UCX's ``UCX_PROTO_INFO=y`` tables in ``text`` (a log): ``"<endpoint kind>: <operation>"``
    (kind ``self``, ``intra-node`` or ``inter-node``) -> the UCX transports its protocols use,
    sorted (every size range). UCX heads a table with its context and the operation on one line
    (``| ucp_context_0 intra-node cfg#1 | remote memory read by ucp_get* … |``) or on two."""
    found: dict[str, set[str]] = {}
    kind = op = None
    for line in text.splitlines():
        if (context := _UCX_CONTEXT.search(line)) is not None:
            kind = context[1]
        if (head := _UCX_OP.search(line)) is not None:
            op = f"{kind}: {head[1]}" if kind else head[1]
            found.setdefault(op, set())
        elif op is not None and (row := _UCX_ROW.search(line)) is not None:
            found[op].update(_UCX_TL.findall(row[1]))
    return {k: sorted(v) for k, v in found.items()}


def merge_protocols(*tables: dict[str, list[str]]) -> dict[str, list[str]]:
    """The union of several engines' :func:`ucx_protocols`."""
    out: dict[str, set[str]] = {}
    for table in tables:
        for op, tls in table.items():
            out.setdefault(op, set()).update(tls)
    return {k: sorted(v) for k, v in out.items()}


def _between_engines(op: str) -> bool:
    """A remote-memory operation (NIXL's READs and WRITEs) on an endpoint to another process."""
    return "remote memory" in op and not op.startswith("self:")


def ucx_transport(protocols: dict[str, list[str]]) -> str:
    """``UCX cuda_ipc`` (or ``UCX rc_mlx5+tcp``, …): the transports of the remote-memory
    operations between the engines (NIXL's READs and WRITEs; those on GPU memory where UCX
    printed any); "?" with a reason when UCX printed none."""
    ops = [op for op in protocols if _between_engines(op)]
    ops = [op for op in ops if "cuda" in op] or ops
    rma = sorted({tl for op in ops for tl in protocols[op]})
    if rma:
        return "UCX " + "+".join(rma)
    if protocols:
        return "? (UCX printed no remote-memory protocol between the engines)"
    return "? (no UCX protocol lines; UCX_PROTO_INFO=y needs UCX 1.16 or later)"


# ---- rates and the table --------------------------------------------------------------------------
def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def transfer_gbps(result: dict, row: str, n: str) -> float | None:
    """KV bytes of the loaded prompt over the time D's leg took beyond a local hit's, GB/s; pull
    rows only (a push D leg includes P's prefill), where D loaded from P (not a recompute)."""
    if "pull" not in row or recomputed(result, row):
        return None
    d_leg, local = _med(result["d_leg_ms"][row][n]), _med(result["ttft_ms"]["local hit"][n])
    if d_leg is None or local is None or d_leg <= local:
        return None
    return int(n) * result["kv_bytes_per_token"] / ((d_leg - local) / 1e3) / 1e9


def prefill_leg(result: dict, row: str, n: str) -> float | None:
    """P's prefill leg of a pull row at ``n`` tokens: the median over the repeats of TTFT − D's
    leg, ms (None for a push row, whose D leg is its TTFT, or a row not run)."""
    ttft, d_leg = result["ttft_ms"][row][n], result["d_leg_ms"][row][n]
    legs = [t - d for t, d in zip(ttft, d_leg) if t > d]
    return _med(legs) if legs and len(ttft) == len(d_leg) else None


def placement(result: dict) -> str:
    """Where P and D ran, in words."""
    devices = result.get("devices")
    if not devices:
        return "P and D on one device"
    tp = result_tp(result)
    if not tp.equal:
        return f"P at TP={tp.p} on devices {devices['P']}, D at TP={tp.d} on devices {devices['D']}"
    if tp.p > 1:
        return f"TP={tp.p} each: P on devices {devices['P']}, D on devices {devices['D']}, rank to rank"
    return f"P on device {devices['P']}, D on device {devices['D']}"


def _ran(result: dict, row: str) -> bool:
    return any(result["ttft_ms"][row][n] for n in map(str, result["lengths"]))


def format_table(result: dict) -> str:
    lines = [f"kvtier-bench pd-engines: vLLM {result['vllm']} on {result['device']}, {placement(result)} "
             f"(gpu_memory_utilization {result.get('gpu_memory_utilization', '?')} each; "
             f"{'CUDA graphs' if result.get('cuda_graphs') else 'eager'}); TTFT ms, median of "
             f"{result['repeats']}; KV {result['kv_bytes_per_token'] >> 10} KiB/token"]
    head = (f"{'row':<24} " + " ".join(f"{n + ' tok':>10} {'D leg':>7} {'GB/s':>5}" for n in map(str, result["lengths"]))
            + "  transport")
    lines += [head, "-" * len(head)]
    transports, skipped = result.get("transport", {}), result.get("skipped", {})
    for row in ROWS:
        if row in skipped and not _ran(result, row):
            lines.append(f"{row:<24} skipped: {skipped[row]}")
            continue
        if not _ran(result, row):
            continue
        cells = []
        for n in map(str, result["lengths"]):
            ttft, d_leg, gbps = _med(result["ttft_ms"][row][n]), _med(result["d_leg_ms"][row][n]), transfer_gbps(result, row, n)
            cells.append(f"{ttft:>10.0f} " if ttft is not None else f"{'-':>10} ")
            cells.append(f"{d_leg:>7.0f} " if d_leg is not None else f"{'-':>7} ")
            cells.append(f"{gbps:>5.1f}" if gbps is not None else f"{'-':>5}")
        transport = "none: D recomputed" if recomputed(result, row) else transports.get(row, "-")
        lines.append(f"{row:<24} " + "".join(cells) + f"  {transport}")
    legs = {row: [prefill_leg(result, row, n) for n in map(str, result["lengths"])] for row in ROWS}
    if any(None not in by_length for by_length in legs.values()):  # what a push is compared with, per connector
        lines.append("P's prefill leg of each pull (TTFT - D's leg, median ms; " + " / ".join(
            f"{n} tok" for n in map(str, result["lengths"])) + "): " + ", ".join(
            f"{row} " + " / ".join(f"{leg:.0f}" for leg in by_length)
            for row, by_length in legs.items() if None not in by_length))
    lines.append("engine start (s): " + ", ".join(f"{k} {v:.1f}" for k, v in result["start_s"].items()))
    if result.get("ucx_cuda_ipc_cache"):
        lines.append(f"UCX_CUDA_IPC_CACHE in the engines: {result['ucx_cuda_ipc_cache']} (n: a peer's GPU memory "
                     "mapped per transfer; y: kept mapped, a stopped peer's KV cache stays held)")
    lines += [f"GPU memory of {name} after it stopped: {r['held_mib']} MiB still held {r['s']} s later"
              for name, r in result.get("d_gpu_released", {}).items()]
    for row, by_length in result.get("d_stages_ms", {}).items():
        for n, stages in by_length.items():
            lines.append(f"where {row}'s D leg went at {n} tokens (median ms, kvtier timeline): "
                         + ", ".join(f"{stage} {_med(ms):.1f}" for stage, ms in stages.items()))
    lines += [f"transport: {line}" for line in result["transport_lines"]]
    lines += (result.get("d_profile") or {}).get("lines", [])
    for pair, protocols in result.get("ucx", {}).items():
        lines += [f"UCX ({pair}): {op}: {', '.join(tls) or '?'}" for op, tls in protocols.items() if _between_engines(op)]
    if note := recompute_note(result):
        lines.append(note)
    lines.append("every P/D answer loaded the prompt and matched P's first token: "
                 + ("yes" if not result["failures"] else "NO: " + "; ".join(result["failures"][:5]))
                 + ("; the rows that recomputed loaded nothing, by design, and were checked for P's first token only"
                    if note else ""))
    lines.append("pull TTFT = P's prefill leg + D's leg; pull after lease: the same, D asking once P's lease "
                 f"({result.get('hbm_lease_ms', '?')} ms) + 500 ms passed (the wait not counted); push TTFT = D's leg "
                 f"(both sent at once; 'kvtier push nixl': D's pd_hbm_push {result.get('hbm_push', ['read'])[0]}); "
                 "GB/s (pull) = KV bytes / (D's leg - local hit)")
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> str | None:
    """A grouped bar chart, TTFT per row and length; a message instead when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    rows = [r for r in ROWS if _ran(result, r)]
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(rows), 4))
    width = 0.8 / len(result["lengths"])
    for i, n in enumerate(result["lengths"]):
        values = [_med(result["ttft_ms"][r][str(n)]) or 0.0 for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], values, width, label=f"{n} tokens")
    ax.set_xticks([x + width * (len(result["lengths"]) - 1) / 2 for x in range(len(rows))], rows, rotation=20, ha="right")
    ax.set_ylabel("TTFT, ms (median)")
    ax.set_title(f"P/D on {result['device']}, {placement(result)} (vLLM {result['vllm']})")
    ax.legend()
    save_figure(fig, path)
    return None
