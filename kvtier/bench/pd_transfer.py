"""The P/D transfer benchmark: a prompt's KV from a producer's CPU tier into a consumer's engine blocks.

The producer (P) is a real worker half in its own process: it publishes the prompt through the
save path (gather, seal, store, pin) and serves it from its chunk server. The bench process is
the consumer (D): a real worker half whose load executor fetches the chunks over loopback TCP,
verifies them and scatters them into its engine blocks, then keeps the full chunks in its CPU
tier, once over each transport: ZMQ (chunks as frames) and NIXL (D READs them from P's
registered CPU pool; skipped when NIXL is not installed). Side by side in the same run, on the
same bytes: a raw ZMQ stream of the same chunk sizes with the same window between the same two
processes, raw NIXL READs of the same chunk sizes with the same window between the same two
agents (neither verifies or scatters), and a raw memcpy of the whole KV. D's blocks are compared
with P's byte for byte after every transfer.

``--tp 2:1,1:2`` adds the same transfer between P and D of those TP sizes, each rank holding its
share of the KV heads: P's ranks in the producer process, D's in this one, every pair timed in the
same repeats on the same prompt (:mod:`kvtier.bench.pd_transfer_tp`, which also holds the geometry).
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field

from kvtier.bench.common import (NO_MATPLOTLIB, BenchError, VerifyError, make_parent, parse_tokens, positive, pyplot,
                                 save_figure)
from kvtier.bench.pd_tp import TpSizes
from kvtier.bench.pd_transfer_tp import (BLOCK, Consumers, Shape, TpTransferResult, format_tp_table, heads_problem,
                                         offered, parse_pairs, publish)


@dataclass(frozen=True, slots=True)
class PdTransferResult:
    prompt_tokens: int
    chunk_tokens: int
    kv_bytes: int  # payload bytes moved per transfer
    memcpy_ms: list[float]
    zmq_ms: list[float]
    kvtier_ms: list[float]  # kvtier over ZMQ
    nixl_ms: list[float]  # raw NIXL READs (empty without NIXL)
    kvtier_nixl_ms: list[float]  # kvtier over NIXL, pull: D READs (empty without NIXL)
    kvtier_push_ms: list[float]  # kvtier over NIXL, push: P WRITEs into D's buffers (empty without NIXL)
    tp_pairs: list[TpTransferResult] = field(default_factory=list)  # --tp's pairs (empty: only the default 1:1)

    def gbps(self, samples: list[float], stat: str) -> float:
        ms = min(samples) if stat == "best" else statistics.median(samples)
        return self.kv_bytes / ms / 1e6


def add_parser(commands) -> None:
    """Register ``kvtier-bench pd-transfer``."""
    p = commands.add_parser("pd-transfer", help="time a P/D transfer of a prompt's KV against raw ZMQ, raw NIXL and memcpy",
                            description="A producer process publishes a prompt's KV; this process loads it as a P/D "
                            "consumer (fetch, verify, scatter) over ZMQ and over NIXL and, side by side, moves the "
                            "same bytes with raw ZMQ and raw NIXL READs.")
    p.add_argument("--prompt-len", type=parse_tokens, default=8 << 10, metavar="TOKENS", help="prompt length (default 8k)")
    p.add_argument("--chunk-tokens", type=positive, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--layers", type=positive, default=12, help="layers (default 12: a ~100M-parameter Llama)")
    p.add_argument("--kv-heads", type=positive, default=4, help="KV heads per layer (default 4)")
    p.add_argument("--head-dim", type=positive, default=64, help="head dimension (default 64)")
    p.add_argument("--tp", type=parse_pairs, default=(TpSizes(1, 1),), metavar="P:D[,P:D...]",
                   help="pairs of P's and D's TP sizes, each dividing --kv-heads, timed side by side (N: N:N; "
                   "default 1:1: only the rows above); e.g. 1:1,2:1,1:2,2:2")
    p.add_argument("--repeats", type=positive, default=5, help="samples per path (default 5)")
    p.add_argument("--stat", choices=("best", "median"), default="best", help="which sample the table shows")
    p.add_argument("--json", metavar="FILE", help="write every sample to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="write a bar chart (needs matplotlib)")
    p.set_defaults(run=_main, parser=p)


def _producer(shape: Shape, tmp: str, p_sizes: list[int], conn) -> None:
    """P: publish the prompt from blocks ``[0, blocks)``, and so do the ranks of each TP size in ``p_sizes``;
    serve it, and a raw ZMQ stream, until told to stop. Asked ``"cut_s"``, it answers each TP size's
    seconds its ranks' serving threads spent cutting chunks to D ranks' heads since start."""
    import torch
    import zmq

    from kvtier.jobs import SaveJob

    alloc = shape.kv(seed=1)
    side = shape.engine(alloc, tmp, "p", produce=True)
    keys = shape.keys()
    side.save((SaveJob("p", tuple(keys), tuple(range(shape.blocks)), publish="bench", final=True),))
    side.transfers.drain()
    tp_ranks = publish(shape, tmp, p_sizes)
    tp_agents = [s.nixl for ranks in tp_ranks.values() for s in ranks.sides if s.nixl_ready()]
    raw = zmq.Context.instance().socket(zmq.ROUTER)
    raw_port = raw.bind_to_random_port("tcp://127.0.0.1")
    chunk_bytes = side.transfers.chunk_bytes
    payload = bytes(chunk_bytes)
    nixl = None
    if side.nixl_ready():  # raw NIXL: the same chunk sizes from a buffer registered with P's agent
        lent = torch.ones(len(keys) * chunk_bytes, dtype=torch.uint8)
        side.nixl.register([(lent.data_ptr(), lent.numel())])
        nixl = (side.nixl.metadata(), lent.data_ptr())
    conn.send((side.chunk_server.port, raw_port, alloc[:, : shape.blocks].clone().view(torch.int32).numpy(), nixl,
               offered(tp_ranks, shape.blocks)))
    poller = zmq.Poller()
    poller.register(raw, zmq.POLLIN)
    while True:
        if conn.poll(0):
            if conn.recv() == "stop":
                break
            conn.send({p: sum(s.chunk_server.cut_s for s in ranks.sides) for p, ranks in tp_ranks.items()})
        if poller.poll(10):
            identity, _ = raw.recv_multipart()
            raw.send_multipart([identity, payload])  # one chunk per request, as the chunk server answers
        if nixl is not None:
            side.nixl.progress()  # no progress thread: the passive side lets NIXL wire up new peers
        for agent in tp_agents:
            agent.progress()
    raw.close()
    side.close()
    for ranks in tp_ranks.values():
        ranks.close()


def _raw_zmq(port: int, chunks: int) -> float:
    """ms to stream ``chunks`` chunks with the consumer's window of requests in flight."""
    import zmq

    from kvtier.pd.route import WINDOW

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(b"warm")
    sock.recv(copy=False)
    start = time.perf_counter()
    sent = 0
    for i in range(chunks):
        while sent < chunks and sent < i + WINDOW:
            sock.send(b"c")
            sent += 1
        sock.recv(copy=False)
    ms = (time.perf_counter() - start) * 1e3
    sock.close()
    return ms


def _raw_nixl(agent, peer: str, remote_base: int, local_base: int, chunk_bytes: int, chunks: int) -> float:
    """ms to READ ``chunks`` chunks of ``chunk_bytes``, the consumer's window of READs in flight."""
    from kvtier.pd.route import WINDOW

    start = time.perf_counter()
    posted = []
    for i in range(chunks):
        while len(posted) < chunks and len(posted) < i + WINDOW:
            j = len(posted)
            posted.append(agent.read(peer, [(local_base + j * chunk_bytes, chunk_bytes)],
                                     [(remote_base + j * chunk_bytes, chunk_bytes)]))
        posted[i].wait(30.0)
        posted[i].release()
    return (time.perf_counter() - start) * 1e3


def run(shape: Shape, repeats: int, progress, tp_pairs: tuple[TpSizes, ...] = ()) -> PdTransferResult:
    """Time every path ``repeats`` times, each repeat every path once; ``tp_pairs``: also P and D of those
    TP sizes (:mod:`kvtier.bench.pd_transfer_tp`)."""
    import numpy as np
    import torch

    from kvtier.jobs import LoadJob, RemoteSource

    tmp = tempfile.mkdtemp(prefix="kvtier-bench-pd-")
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p_sizes = list(dict.fromkeys(tp.p for tp in tp_pairs))
    producer = ctx.Process(target=_producer, args=(shape, tmp, p_sizes, child), daemon=True)
    consumers = None
    progress("starting the producer process and publishing the prompt")
    producer.start()
    try:
        deadline = time.monotonic() + 300
        while not parent.poll(1):
            if not producer.is_alive() or time.monotonic() > deadline:
                raise BenchError("the producer process died or did not publish the prompt within 300 s")
        port, raw_port, expected, p_nixl, tp_offered = parent.recv()
        alloc = shape.kv(seed=2)
        side = shape.engine(alloc, tmp, "d", produce=False)
        keys = shape.keys()
        chunk_bytes = side.transfers.chunk_bytes
        kv_bytes = shape.blocks * side.transfers.layout.bytes_per_block
        src, dst = alloc[:, : shape.blocks], torch.empty_like(alloc[:, : shape.blocks])
        agent = side.nixl if p_nixl is not None and side.nixl_ready() else None
        if agent is not None:
            landing = torch.zeros(len(keys) * chunk_bytes, dtype=torch.uint8)
            agent.register([(landing.data_ptr(), landing.numel())])
            peer = agent.connect(p_nixl[0])
            _raw_nixl(agent, peer, p_nixl[1], landing.data_ptr(), chunk_bytes, len(keys))  # wire-up, untimed
        else:
            progress("NIXL is not installed here (pip install nixl-cu12): its rows are left out")
        if tp_pairs:
            def cut_s(p: int) -> float:
                parent.send("cut_s")
                if not parent.poll(30):
                    raise BenchError("the producer process did not answer")
                return parent.recv()[p]

            consumers = Consumers(shape, tp_pairs, tmp, tp_offered, progress, cut_s)

        def transfer(r: int, transport: str, push: bool = False) -> float:
            side.nixl = agent if transport == "nixl" else None  # what D offers P in the handshake
            alloc[:, shape.blocks :].zero_()
            job = LoadJob(f"d{r}-{transport}-{push}", tuple(keys), 0, tuple(range(shape.blocks, 2 * shape.blocks)),
                          0, RemoteSource(f"bench-{uuid.uuid4().hex}", (f"tcp://127.0.0.1:{port}",), 0, push))
            start = time.perf_counter()
            side.start_loads((job,))
            while job.req_id not in side.finished_loads():
                time.sleep(0.0005)
            ms = (time.perf_counter() - start) * 1e3
            if side.failed_blocks():
                raise BenchError(f"the transfer over {transport} failed; see the log above")
            if not np.array_equal(alloc[:, shape.blocks :].view(torch.int32).numpy(), expected):  # bits, not floats
                raise VerifyError(f"the consumer's blocks differ from the producer's (over {transport})")
            return ms

        memcpy_ms, zmq_ms, kvtier_ms, nixl_ms, kvtier_nixl_ms, kvtier_push_ms = [], [], [], [], [], []
        for r in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            memcpy_ms.append((time.perf_counter() - start) * 1e3)
            zmq_ms.append(_raw_zmq(raw_port, len(keys)))
            kvtier_ms.append(transfer(r, "zmq"))
            line = (f"repeat {r + 1}/{repeats}: memcpy {memcpy_ms[-1]:.1f} ms, raw ZMQ {zmq_ms[-1]:.1f} ms, "
                    f"kvtier over ZMQ {kvtier_ms[-1]:.1f} ms")
            if agent is not None:
                nixl_ms.append(_raw_nixl(agent, peer, p_nixl[1], landing.data_ptr(), chunk_bytes, len(keys)))
                kvtier_nixl_ms.append(transfer(r, "nixl"))
                kvtier_push_ms.append(transfer(r, "nixl", push=True))
                line += (f", raw NIXL {nixl_ms[-1]:.1f} ms, kvtier over NIXL pull {kvtier_nixl_ms[-1]:.1f} ms, "
                         f"push {kvtier_push_ms[-1]:.1f} ms")
            progress(line)
            if consumers is not None:
                progress(f"repeat {r + 1}/{repeats}: {consumers.repeat(r)}")
        side.nixl = agent
        if agent is not None:
            agent.deregister([(landing.data_ptr(), landing.numel())])
        side.close()
    finally:
        if consumers is not None:
            consumers.close()
        parent.send("stop")
        producer.join(30)
        if producer.is_alive():
            producer.kill()
    return PdTransferResult(shape.prompt_tokens, shape.chunk_tokens, kv_bytes, memcpy_ms, zmq_ms, kvtier_ms, nixl_ms,
                            kvtier_nixl_ms, kvtier_push_ms, consumers.results(kv_bytes) if consumers else [])


def format_table(result: PdTransferResult, stat: str) -> str:
    memcpy = result.gbps(result.memcpy_ms, stat)
    zmq = result.gbps(result.zmq_ms, stat)
    nixl = result.gbps(result.nixl_ms, stat) if result.nixl_ms else None
    lines = [f"P/D transfer of {result.prompt_tokens} tokens ({result.kv_bytes / 2**20:.0f} MiB of KV, "
             f"{result.chunk_tokens}-token chunks), {stat} of {len(result.kvtier_ms)}",
             f"{'path':<50} {'ms':>9} {'GB/s':>7} {'× memcpy':>9} {'× raw ZMQ':>10} {'× raw NIXL':>11}"]
    for name, samples in _rows(result):
        ms = min(samples) if stat == "best" else statistics.median(samples)
        gbps = result.gbps(samples, stat)
        vs_nixl = f"{gbps / nixl:>11.2f}" if nixl else f"{'-':>11}"
        lines.append(f"{name:<50} {ms:>9.1f} {gbps:>7.2f} {gbps / memcpy:>9.2f} {gbps / zmq:>10.2f} {vs_nixl}")
    if result.tp_pairs:
        lines += ["", format_tp_table(result.tp_pairs)]
    return "\n".join(lines)


def _rows(result: PdTransferResult) -> list[tuple[str, list[float]]]:
    rows = [("raw memcpy (host to host)", result.memcpy_ms), ("raw ZMQ, same chunks and window", result.zmq_ms),
            ("raw NIXL READ, same chunks and window", result.nixl_ms),
            ("kvtier over ZMQ: fetch + verify + scatter + keep", result.kvtier_ms),
            ("kvtier over NIXL, pull: D READs, verify, scatter", result.kvtier_nixl_ms),
            ("kvtier over NIXL, push: P WRITEs, verify, scatter", result.kvtier_push_ms)]
    return [(name, samples) for name, samples in rows if samples]


def _plot(result: PdTransferResult, path: str, stat: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    short = {"raw memcpy (host to host)": "memcpy", "raw ZMQ, same chunks and window": "raw ZMQ",
             "raw NIXL READ, same chunks and window": "raw NIXL", "kvtier over ZMQ: fetch + verify + scatter + keep":
             "kvtier ZMQ", "kvtier over NIXL, pull: D READs, verify, scatter": "kvtier NIXL pull",
             "kvtier over NIXL, push: P WRITEs, verify, scatter": "kvtier NIXL push"}
    rows = [(short[name], samples) for name, samples in _rows(result)]
    rows += [(f"kvtier {r.transport.upper()}\nTP {r.tp.p}→{r.tp.d}", r.ms) for r in result.tp_pairs]
    names = [name for name, _ in rows]
    values = [result.gbps(samples, stat) for _, samples in rows]
    fig, ax = plt.subplots(figsize=(max(8.5, 1.1 * len(rows)), 3.2))
    ax.bar(names, values, color=["#3366aa" if "TP " in n else "#cc6633" if n.startswith("kvtier") else "#999999"
                                 for n in names])
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title(f"P/D transfer, {result.prompt_tokens} tokens ({stat} of {len(result.kvtier_ms)})")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    save_figure(fig, path)
    return None


def _main(parser, args) -> int:
    import sys

    if args.chunk_tokens % BLOCK or args.prompt_len % args.chunk_tokens:
        parser.error(f"argument --prompt-len: {args.prompt_len} must be a whole number of chunks of --chunk-tokens "
                     f"{args.chunk_tokens}, itself a multiple of {BLOCK}.")
    if problem := heads_problem(args.tp, args.kv_heads):
        parser.error(f"argument --tp: {problem}.")
    tp_pairs = () if args.tp == (TpSizes(1, 1),) else args.tp  # the default: the rows above, no TP pairs
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {message}", file=sys.stderr, flush=True)

    shape = Shape(args.layers, args.kv_heads, args.head_dim, args.prompt_len, args.chunk_tokens)
    try:
        result = run(shape, args.repeats, progress, tp_pairs)
    except VerifyError as exc:
        print(f"kvtier-bench: VERIFICATION FAILED: {exc}", file=sys.stderr)
        return 1
    except BenchError as exc:
        print(f"kvtier-bench: error: {exc}", file=sys.stderr)
        return 1
    print(format_table(result, args.stat), flush=True)
    if args.json:
        make_parent(args.json)
        with open(args.json, "w") as f:
            json.dump({**asdict(result), "tp_pairs": [r.as_json() for r in result.tp_pairs], "stat": args.stat}, f,
                      indent=1)
        progress(f"wrote {args.json}")
    if args.plot:
        progress(_plot(result, args.plot, args.stat) or f"wrote {args.plot}")
    return 0
