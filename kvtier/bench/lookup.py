"""The lookup benchmark: how long the scheduler waits to learn how much of a prompt is stored.

Rank 0's :class:`~kvtier.lookup.LookupServer` runs in its own process, as it does in a worker;
``world_size`` real :class:`~kvtier.lookup.HoldReporter` s commit every chunk of ``--prompts``
distinct prompts through it; then the bench process asks with a :class:`~kvtier.lookup.LookupClient`
over the IPC socket, as the scheduler does, and times each round trip, all chunks hitting (the
longest answer): once per prompt (*first lookup*: the server maps each chain key to every rank's
storage key) and ``--samples`` times for one prompt (*repeat*: what a waiting request costs per
scheduler step). Computing a prompt's chain keys happens once per request and is timed apart.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass

import numpy as np

from kvtier.bench.common import BenchError, parse_tokens, positive
from kvtier.keys import chunk_keys, namespace, storage_key


@dataclass(frozen=True, slots=True)
class LookupResult:
    prompt_tokens: int
    chunk_tokens: int
    chunks: int
    world_size: int
    samples: int
    lookup_us: dict[str, float]  # repeat lookups: p50 / p99 / max of the round trip, microseconds
    first_lookup_us: dict[str, float]  # first lookup of each prompt, likewise
    keys_us: dict[str, float]  # p50 / p99 of computing the chain keys, microseconds


def add_parser(commands) -> None:
    """Register ``kvtier-bench lookup``."""
    p = commands.add_parser("lookup", help="time the scheduler's lookup of a long prompt over ZMQ",
                            description="Commit a prompt's chunks from every rank through rank 0's lookup server "
                            "(its own process, IPC socket), then time the scheduler's lookup round trips.")
    p.add_argument("--prompt-len", type=parse_tokens, default=32 << 10, metavar="TOKENS", help="prompt length (default 32k)")
    p.add_argument("--chunk-tokens", type=positive, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--world-size", type=positive, default=2, help="TP ranks that commit each chunk (default 2)")
    p.add_argument("--samples", type=positive, default=2000, help="timed repeat lookups (default 2000)")
    p.add_argument("--prompts", type=positive, default=200, help="distinct prompts, each looked up once first (default 200)")
    p.add_argument("--json", metavar="FILE", help="write the numbers to FILE")
    p.set_defaults(run=_main, parser=p)


def _serve(endpoint: str, world_size: int, ready, stop) -> None:
    from kvtier.lookup import LookupServer

    server = LookupServer(endpoint, world_size)
    ready.set()
    stop.wait()
    server.close()


def run(prompt_tokens: int, chunk_tokens: int, world_size: int, samples: int, prompts: int = 200) -> LookupResult:
    from kvtier.lookup import HoldReporter, LookupClient

    rng = np.random.default_rng(0)
    root = namespace("kvtier-bench", uuid.uuid4().hex)
    keys_us, every = [], []
    for _ in range(prompts):
        tokens = rng.integers(0, 128_000, prompt_tokens).tolist()
        begin = time.perf_counter()
        every.append(chunk_keys(tokens, chunk_tokens, root))
        keys_us.append((time.perf_counter() - begin) * 1e6)
    keys = every[0]
    if not keys:
        raise BenchError(f"a {prompt_tokens}-token prompt has no full chunk of {chunk_tokens} tokens.")

    endpoint = f"ipc://{os.path.join(tempfile.gettempdir(), f'kvtier-bench-lookup-{uuid.uuid4().hex[:8]}.sock')}"
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    server = ctx.Process(target=_serve, args=(endpoint, world_size, ready, stop), daemon=True)
    server.start()
    client = None
    reporters = []
    try:
        if not ready.wait(60):
            raise BenchError("the lookup server process did not start.")
        for rank in range(world_size):
            fingerprint = bytes([rank]) * 16
            held = {storage_key(k, fingerprint): "cpu" for ks in every for k in ks}
            reporter = HoldReporter(endpoint, rank, world_size, fingerprint, held.get)
            reporter.changed(list(held))
            reporters.append(reporter)
        client = LookupClient(endpoint, 5000)
        deadline = time.monotonic() + 30
        while len(client.prefix_tiers(every[-1])) != len(keys):  # the commits have landed
            if time.monotonic() > deadline:
                raise BenchError("the prompt's chunks never became visible to lookups.")
            time.sleep(0.01)
        first_us = []
        for ks in every[1:]:
            begin = time.perf_counter()
            reply = client.lookup(ks)
            first_us.append((time.perf_counter() - begin) * 1e6)
            if reply is None or len(reply.tiers) != len(keys):
                raise BenchError("a lookup did not find every chunk.")
        for _ in range(100):  # warm-up
            client.lookup(keys)
        lookup_us = []
        for _ in range(samples):
            begin = time.perf_counter()
            reply = client.lookup(keys)
            lookup_us.append((time.perf_counter() - begin) * 1e6)
            if reply is None or len(reply.tiers) != len(keys):
                raise BenchError("a lookup did not find every chunk.")
    finally:
        if client is not None:
            client.close()
        for reporter in reporters:
            reporter.close()
        stop.set()
        server.join(10)
    return LookupResult(prompt_tokens, chunk_tokens, len(keys), world_size, samples,
                        _percentiles(lookup_us, with_max=True), _percentiles(first_us, with_max=True),
                        _percentiles(keys_us))


def _percentiles(values: list[float], with_max: bool = False) -> dict[str, float]:
    out = {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}
    if with_max:
        out["max"] = float(max(values))
    return {k: round(v, 1) for k, v in out.items()}


def format_result(r: LookupResult) -> str:
    return "\n".join([
        f"kvtier lookup: {r.prompt_tokens}-token prompt = {r.chunks} chunks of {r.chunk_tokens} tokens, "
        f"committed by {r.world_size} ranks; {r.samples} lookups over IPC, server in its own process",
        f"  repeat lookup       p50 {r.lookup_us['p50']:8.1f} us   p99 {r.lookup_us['p99']:8.1f} us   "
        f"max {r.lookup_us['max']:8.1f} us",
        f"  first lookup        p50 {r.first_lookup_us['p50']:8.1f} us   p99 {r.first_lookup_us['p99']:8.1f} us   "
        f"max {r.first_lookup_us['max']:8.1f} us",
        f"  chain keys (once)   p50 {r.keys_us['p50']:8.1f} us   p99 {r.keys_us['p99']:8.1f} us",
    ])


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import json
    import sys

    try:
        result = run(args.prompt_len, args.chunk_tokens, args.world_size, args.samples, max(2, args.prompts))
    except BenchError as exc:
        print(f"kvtier-bench: error: {exc}", file=sys.stderr)
        return 1
    print(format_result(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result), f, indent=2)
    return 0
