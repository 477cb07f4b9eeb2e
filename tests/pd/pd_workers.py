"""Two real worker halves in one process, a prefill engine's (P) and a decode engine's (D): real
LMCache stores, real ZMQ sockets (lookup over IPC, chunk transfer over loopback TCP), KV memory
laid out as vLLM-CPU lays it out. What vLLM's scheduler would send them is built by hand."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from kvtier.config import KvtierConfig
from kvtier.engines.vllm.worker_side import WorkerSide
from kvtier.jobs import LoadJob, RemoteSource, SaveJob
from kvtier.keys import chunk_keys, namespace, tail_key

BLOCK = 16  # tokens per engine block
CHUNK = 32  # tokens per chunk: two blocks
NUM_BLOCKS = 64
MODEL = "tiny"


@dataclass
class Engine:
    """One engine's worker half and its KV memory ``[NUM_BLOCKS, heads, BLOCK, 2*head]`` per layer
    (vLLM-CPU), or with ``nhd`` ``[2, NUM_BLOCKS, block, heads, head]`` (flash attention's NHD)."""

    side: WorkerSide
    kv: torch.Tensor  # [layers, NUM_BLOCKS, 2, BLOCK, 32] float32 (nhd: [layers, 2, NUM_BLOCKS, block, 2, 16] bf16)

    def blocks(self, ids) -> torch.Tensor:
        return self.kv[:, list(ids)].clone()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.side.chunk_server.port}"

    def wait_loaded(self, req_id: str, timeout_s: float = 20.0) -> set[int]:
        """Block ids that failed once ``req_id``'s load reported (as the connector would tell vLLM)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if req_id in self.side.finished_loads():
                return self.side.failed_blocks()
            time.sleep(0.005)
        raise AssertionError(f"load of {req_id} never reported")


def make_engine(tmp_path, name: str, seed: int, produce: bool = True, layers: int = 2, block: int = BLOCK,
                nhd: bool = False, rank_of: tuple[int, int] | None = None, **config) -> Engine:
    """``rank_of``: ``(rank, tp_size)``, the engine is that rank, holding its share of the 2 KV heads of
    the KV ``seed`` makes (vLLM-CPU's layout only), its chunks pieces keyed by their heads (any TP size
    reads them); None: a TP=1 engine whose chunks are its own."""
    generator = torch.Generator().manual_seed(seed)
    if nhd:
        kv = torch.randn(layers, 2, NUM_BLOCKS, block, 2, 16, generator=generator).to(torch.bfloat16)
    else:
        kv = torch.randn(layers, NUM_BLOCKS, 2, block, 32, generator=generator)
    rank, tp_size = rank_of or (0, 1)
    if rank_of is not None:
        kv = kv.narrow(2, rank * 2 // tp_size, 2 // tp_size).contiguous()
    cfg = KvtierConfig.from_dict({"chunk_tokens": CHUNK, "cpu_bytes": 16 << 20, "pd_timeout_ms": 1000, **config})
    side = WorkerSide(cfg, MODEL, block, NUM_BLOCKS, f"ipc://{tmp_path}/{name}.sock", rank, tp_size, produce=produce,
                      heads=(2 // tp_size, 2) if rank_of is not None else None)
    side.register({f"layer.{i}": kv[i] for i in range(layers)})
    return Engine(side, kv)


def prompt_keys(tokens: list[int]) -> tuple[list[bytes], bytes | None]:
    root = namespace(MODEL)
    keys = chunk_keys(tokens, CHUNK, root)
    return keys, tail_key(tokens, CHUNK, root, keys)


def publish(p: Engine, tokens: list[int], blocks: list[int], transfer_id: str, lease: bool = False) -> list[bytes]:
    """What P's scheduler half plans for a producer request computed in one step (``lease``: whose
    blocks it will lend when the request finishes); returns all keys."""
    keys, tail = prompt_keys(tokens)
    all_keys = keys + ([tail] if tail else [])
    p.side.save((SaveJob("p-req", tuple(all_keys), tuple(blocks), publish=transfer_id, final=True, lease=lease),))
    return all_keys


def remote_job(req_id: str, tokens: list[int], blocks: list[int], transfer_id: str, endpoint: str | tuple[str, ...],
               wait: bool = False, first_chunk: int = 0, start_chunk: int = 0, block: int = BLOCK,
               producer_blocks: tuple[int, ...] = ()) -> LoadJob:
    """What D's scheduler half plans for a consumer request with no local hit: the whole prompt
    (``producer_blocks``: P's blocks, as its params named them, from the first fetched chunk on;
    ``endpoint``: P's chunk server, or each of its TP ranks' in rank order)."""
    keys, tail = prompt_keys(tokens)
    all_keys = keys + ([tail] if tail else [])
    tail_blocks = -(-(len(tokens) - len(keys) * CHUNK) // block) if tail else 0
    skip = start_chunk * CHUNK // block
    endpoints = endpoint if isinstance(endpoint, tuple) else (endpoint,)
    return LoadJob(req_id, tuple(all_keys[start_chunk:]), 0, tuple(blocks[skip:]), tail_blocks,
                   RemoteSource(transfer_id, endpoints, first_chunk, wait, tuple(producer_blocks)))


def tokens_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    """Until ``predicate()`` holds (fails the test after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.005)


def advertise_shifted_regions(d: Engine, monkeypatch, shift: int = 1 << 46) -> None:
    """What ``d`` sends a producer (its second hello, push "write") names its engine KV regions
    ``shift`` bytes past where they are and were registered with NIXL: the producer's WRITEs into
    the blocks ``d`` names point outside ``d``'s registration, and NIXL refuses them."""
    kv = d.side.engine_kv
    landing = kv.landing
    monkeypatch.setattr(kv, "landing", lambda targets: (made := landing(targets)) and dataclasses.replace(
        made, regions=tuple(dataclasses.replace(r, base=r.base + shift) for r in made.regions)))
