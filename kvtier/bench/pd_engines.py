"""``kvtier-bench pd-engines``: P/D between two vLLM engines, on one device or a device each:
kvtier (pull from P's engine blocks HBM to HBM and from its CPU tier, push, over NIXL and over ZMQ)
against vLLM's own ``NixlConnector`` and ``NixlPushConnector``, in one run.

A prefill engine (P) and a decode engine (D), each a process of its own session
(:mod:`kvtier.bench.pd_engine_proc` runs :mod:`kvtier.bench.pd_child`, ended through its group).
Without ``--devices`` both share the visible device, each taking ``--gpu-memory-utilization``
(default 0.35) of it; ``--devices 0,1`` sets P's ``CUDA_VISIBLE_DEVICES`` to 0 and D's to 1 (default
share 0.8: each has a GPU of its own). ``--tp 2`` starts both engines at TP=2 (``--devices``
then lists P's two GPUs and D's two), ``--tp 2:1`` P at TP=2 and D at TP=1 (three devices); the
result's ``"tp"`` is ``{"P": 2, "D": 1}``. At unequal sizes kvtier's D ranks gather their KV heads
from P's ranks (a D that loaded nothing is noted), ``nixl`` runs where one size divides the other
and ``nixl-push`` is skipped (:mod:`kvtier.bench.pd_tp`). Pairs (``--pairs``), one after the other:

* ``kvtier``: P with kvtier (``pd_transport`` auto, ``pd_hbm_lease_ms`` ``--hbm-lease-ms``: P keeps a
  finished P/D request's engine blocks that long) and D with kvtier over NIXL; then D again over
  ZMQ (P stays up). Rows: ``recompute`` (a new prompt on P), ``local hit`` (the same prompt on P
  again), ``kvtier pull hbm`` (P prefills with ``max_tokens`` 1 and ``do_remote_decode``; D then
  answers with P's ``kv_transfer_params`` and READs P's blocks HBM to HBM: TTFT = P's leg + D's
  leg), ``kvtier pull after lease`` (the same, but D asks once P's lease has passed, lease + 500 ms
  later, and gets P's CPU-tier chunks over NIXL; the wait is not counted), ``kvtier push nixl``
  (both legs sent at once under one ``transfer_id``: TTFT = D's leg), and ``kvtier pull zmq``,
  ``kvtier push zmq`` over ZMQ;
* ``nixl``: P and D with ``NixlConnector`` (``kv_both``): ``NixlConnector pull`` as above;
* ``nixl-push``: P and D with ``NixlPushConnector``: ``NixlPushConnector push``, both legs sent at
  once under one request id, D naming P's engine and side channel (as vLLM's push proxy demo
  does; :meth:`kvtier.bench.pd_engines_rows.Run.push_legs`); skipped, with the reason printed,
  where vLLM's connector factory has no ``NixlPushConnector``.

Every leg is one ``generate`` call with ``max_tokens`` 1, timed in its engine: D's leg is its time
to first token, which includes waiting for the KV. Each P/D request must show in D's answer that
D loaded all but the prompt's last chunk (``num_cached_tokens``), and D's first token must equal
the one P computed for the same prompt; either failure makes the exit status 1. D's transfer
rate is ``KV bytes / (D's leg - local hit)``: the KV moved, over the time D's leg took beyond a
prefix-cache hit's. Each row names its transport: a kvtier row from D's ``kvtier P/D: fetching
from`` line, a vLLM connector's from the protocols UCX prints (``UCX_PROTO_INFO=y``, e.g.
``cuda_ipc``, ``rc``, ``tcp``); see :mod:`kvtier.bench.pd_engines_report`. ``--py-spy DIR``
records kvtier's P and D while the longest prompt's repeats run (:mod:`kvtier.bench.pd_spy`);
``--profile DIR`` profiles D's step to its first token after a push and after a pull
(:mod:`kvtier.bench.pd_profile`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from kvtier.bench.common import BenchError, Progress, add_cuda_graphs_flag, names_from, positive, token_lengths
from kvtier.bench.engine_model import LLAMA3_8B
from kvtier.bench.pd_engine_proc import Engine  # noqa: F401 - the GPU tests start engines from here
from kvtier.bench.pd_engines_report import ROWS, format_table, transfer_gbps, write_plot  # noqa: F401 - this command's outputs
from kvtier.bench.pd_engines_rows import Run, engine_env  # noqa: F401 - engine_env: each engine's environment
from kvtier.bench.pd_spy import py_spy
from kvtier.bench.pd_tp import TpSizes, parse_devices, parse_tp

PAIRS = ("kvtier", "nixl", "nixl-push")


def add_parser(commands) -> None:
    """Register ``kvtier-bench pd-engines``."""
    p = commands.add_parser(
        "pd-engines", help="P/D between two vLLM engines: kvtier pull (HBM, CPU tier)/push on NIXL and ZMQ vs vLLM's "
        "NixlConnector and NixlPushConnector",
        description="Start a prefill and a decode engine (a CUDA vLLM: both on one GPU, or one GPU each with "
        "--devices) and time P/D requests: kvtier pull from P's engine blocks (HBM to HBM) and, after P's lease, "
        "from its CPU tier, kvtier push, over NIXL and over ZMQ, vLLM's NixlConnector and NixlPushConnector, "
        "recompute and a local prefix hit. Checks that D loaded each prompt and that its first token equals P's, "
        "and names each row's transport.")
    p.add_argument("--model", help="model directory (default: a Llama-3-8B config with dummy weights)")
    p.add_argument("--load-format", default="dummy", help="vLLM load_format (default dummy)")
    p.add_argument("--prompt-lens", default="8k,32k", help="comma-separated prompt lengths (default 8k,32k)")
    p.add_argument("--repeats", type=positive, default=3, help="prompts per length and row (default 3; median shown)")
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"which engine pairs to run (default {','.join(PAIRS)})")
    p.add_argument("--devices", metavar="P,D", help="P's and D's CUDA_VISIBLE_DEVICES, e.g. 0,1; with --tp P:D, "
                   "P+D devices, P's first: 0,1,2,3 at --tp 2, 0,1,2 at --tp 2:1 (default: both engines on the "
                   "visible device)")
    p.add_argument("--tp", type=parse_tp, default=TpSizes(1, 1), metavar="N|P:D", help="tensor-parallel sizes: N "
                   "for P and D both, P:D apart, e.g. 2:1 (default 1; above 1 needs --devices). At equal sizes each "
                   "rank of D reads from the P rank of its index; at unequal sizes kvtier's D recomputes, "
                   "NixlConnector runs where one size divides the other, NixlPushConnector is skipped")
    p.add_argument("--gpu-memory-utilization", type=float, help="each engine's share of its GPU (default 0.8 when "
                   "--devices gives P and D a GPU each, else 0.35)")
    p.add_argument("--hbm-lease-ms", type=int, default=2000, help="P's pd_hbm_lease_ms: how long P keeps a P/D "
                   "request's engine blocks for D, ms (default 2000; 0: off)")
    p.add_argument("--hbm-push", default="read", help="D's pd_hbm_push over NIXL, comma-separated: read, write or "
                   "read,write (a D for each; the first gives every row, the others their push row, e.g. "
                   "'kvtier push nixl write'; default read)")
    p.add_argument("--zmq", action=argparse.BooleanOptionalAction, default=True, help="also run a kvtier D over ZMQ "
                   "for the 'kvtier pull zmq' and 'kvtier push zmq' rows (--no-zmq: D over NIXL only, one engine "
                   "start fewer)")
    p.add_argument("--cpu-gib", type=positive, default=16, help="kvtier's CPU tier in each engine, GiB (default 16)")
    p.add_argument("--chunk-tokens", type=positive, default=256, help="kvtier's chunk_tokens (default 256)")
    add_cuda_graphs_flag(p)
    p.add_argument("--keep-logs", metavar="DIR", help="write the engines' logs to DIR and keep them")
    p.add_argument("--py-spy", metavar="DIR", help="record kvtier's P and D with py-spy (pip install py-spy) through "
                   "the longest prompt's repeats: DIR/<engine>.speedscope.json, and DIR/summary.txt on where remote "
                   "loads and chunk serving spent their time")
    p.add_argument("--profile", metavar="DIR", help="once the longest prompt's repeats are done, one more pull HBM "
                   "to HBM and one more push (not timed) with kvtier's D under vLLM's torch profiler: its traces in "
                   "DIR/kvtier-D/, and DIR/summary.txt on what D did from the load's end to its first token after the push "
                   "against the pull")
    p.add_argument("--json", metavar="FILE", help="write every sample to FILE (also after each repeat)")
    p.add_argument("--plot", metavar="FILE.png", help="write a bar chart of TTFT per row and length (needs matplotlib)")
    p.set_defaults(run=_main, parser=p)


def memory_share(devices: tuple[str, str] | None, given: float | None) -> float:
    """Each engine's ``gpu_memory_utilization``: ``given``, else 0.8 when P and D have GPUs of their
    own, 0.35 when they share one."""
    if given is not None:
        return given
    return 0.8 if devices is not None and not set(devices[0].split(",")) & set(devices[1].split(",")) else 0.35


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    lengths = token_lengths(parser, args.prompt_lens)
    pairs = names_from(parser, args.pairs, PAIRS, flag="--pairs")
    args.hbm_push = list(dict.fromkeys(names_from(parser, args.hbm_push, ("read", "write"), flag="--hbm-push")))
    try:
        args.devices = parse_devices(args.devices, args.tp)
    except ValueError as exc:
        parser.error(f"argument --devices: {exc}")
    if max(args.tp.p, args.tp.d) > 1 and args.devices is None:
        parser.error("argument --tp: needs --devices, P's GPUs then D's")
    if args.hbm_lease_ms < 0:
        parser.error("argument --hbm-lease-ms: expected 0 or more milliseconds")
    if args.py_spy and py_spy() is None:
        parser.error("argument --py-spy: py-spy is not installed (pip install py-spy)")
    args.gpu_memory_utilization = memory_share(args.devices, args.gpu_memory_utilization)
    progress = Progress("pd-engines")
    with tempfile.TemporaryDirectory(prefix="kvtier-pd-engines-") as tmp:
        model = args.model
        if model is None:
            model = os.path.join(tmp, "llama-3-8b")
            os.makedirs(model)
            with open(os.path.join(model, "config.json"), "w") as f:
                json.dump(LLAMA3_8B, f)
        run = Run(args, model, lengths, progress)
        logs = args.keep_logs or tmp
        os.makedirs(logs, exist_ok=True)
        for name, pair in (("kvtier", run.kvtier_pair), ("nixl", run.nixl_pair),
                           ("nixl-push", lambda workdir: run.nixl_pair(workdir, "nixl-push"))):
            if name in pairs:
                try:
                    pair(logs)
                except BenchError as exc:  # the other pairs still run; the exit status says it failed
                    print(f"kvtier-bench pd-engines: error: {exc}", file=sys.stderr)
                    run.failures.append(f"{name} pair: {str(exc).splitlines()[0]}")
    result = run.result()
    result["elapsed_s"] = progress.elapsed()
    print(format_table(result), flush=True)
    if args.json:
        run.checkpoint()
        progress(f"wrote {args.json}")
    if args.plot:
        progress(write_plot(result, args.plot) or f"wrote {args.plot}")
    return 0 if not result["failures"] else 1
