"""Load and save jobs: what the scheduler side asks a worker to move (they cross process boundaries)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RemoteSource:
    """Where a P/D consumer fetches chunks it lacks: the producer's chunk servers.

    ``transfer_id``: what the producer published the prompt under. ``endpoints``: ZMQ endpoint
    of each producer TP rank (rank r of the consumer fetches from rank r). ``first_chunk``: index
    into the job's keys of the first chunk fetched from the producer (the ones before come from
    the consumer's own tiers). ``wait``: the producer may still be computing the prompt (push: both
    legs were sent at once), so chunks not yet published are waited for, not missed. ``blocks``:
    the producer's engine blocks from the first chunk fetched on, in token order, as its
    ``kv_transfer_params`` named them (a pull's; empty: not named).
    """

    transfer_id: str
    endpoints: tuple[str, ...]
    first_chunk: int
    wait: bool = False
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Load ``len(block_ids)`` blocks of a request from consecutive stored chunks.

    ``keys``: chain keys of the chunks, in prompt order; each holds ``chunk_blocks`` blocks, but
    the last one holds ``tail_blocks`` when non-zero (a prompt's trailing partial chunk, only
    ever fetched from a P/D producer). ``first_block``: the block of the first chunk where loading
    starts (non-zero when the engine already holds the start of that chunk). ``block_ids``: engine
    blocks to fill, in order. ``remote``: set when some chunks come from a P/D producer.
    ``group``: which of the served KV cache groups the blocks are (0: the anchor group; a
    hybrid model's request loads one job per group, and its load ends when all of them have).
    """

    req_id: str
    keys: tuple[bytes, ...]
    first_block: int
    block_ids: tuple[int, ...]
    tail_blocks: int = 0
    remote: RemoteSource | None = None
    group: int = 0


@dataclass(frozen=True, slots=True)
class ChunkBlocks:
    """How the engine names one saved chunk's blocks, so that KV cache events about the chunk
    match the engine's own: ``hashes``: the engine's hash of each block (bytes); ``parent``: the
    hash of the block before the chunk (None for a prompt's first chunk); ``token_ids``: the
    chunk's tokens; ``block_size``: tokens per block; ``extra_keys``: per block, what else the
    engine hashed (cache salt, LoRA name), or None.
    """

    hashes: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple | None = None


@dataclass(frozen=True, slots=True)
class SaveJob:
    """Save chunks: ``block_ids`` holds ``chunk_blocks`` engine blocks per key in order, except
    that the last key may hold fewer (a trailing partial chunk, saved only when published).

    ``publish``: transfer id of a P/D producer request; its chunks are pinned for the decode
    engine. ``final``: this job carries the request's last chunk (the prompt is all published).
    A job with no keys only says the published request is still being computed. ``names``: one
    per full chunk in ``keys``, when the engine publishes KV cache events (else empty).
    ``group``: which of the served KV cache groups the blocks are (0: the anchor group).
    ``lease``: the request's engine blocks will be lent once it finishes (P/D HBM to HBM): the
    chunks' blocks may be written into a decode engine that named its own (push) while the
    request runs, and with ``final`` a decode engine's fetch may wait a moment for the lease.
    """

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    publish: str | None = None
    final: bool = False
    names: tuple[ChunkBlocks | None, ...] = ()
    group: int = 0
    lease: bool = False


@dataclass(frozen=True, slots=True)
class Landed:
    """A producer's chunk that a transfer wrote straight into this engine's blocks (P/D, HBM to
    HBM): ``checksum`` is the KVSUM64 its blocks must have, read region-major as a chunk payload;
    ``nbytes``: bytes moved. ``follows``: the transfer's next chunk has landed too (the same READ,
    or P's word that it WROTE it came): checking both in one pass costs less than two."""

    checksum: int
    nbytes: int
    follows: bool = False


@dataclass(frozen=True, slots=True)
class Lend:
    """A finished P/D producer request whose engine blocks stay for ``lease_ms`` (the free is
    delayed until the workers say the lease ended): published under ``transfer_id``,
    ``block_ids`` in token order, ``keys`` the chain keys of its published chunks in order
    (chunk i starts at block i × blocks per chunk)."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    lease_ms: int


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the workers must do this step (the connector metadata's payload)."""

    loads: tuple[LoadJob, ...]
    saves: tuple[SaveJob, ...]
    cancels: tuple[str, ...] = ()  # aborted requests whose P/D transfer may still be waiting: stop it
    withdrawn: tuple[str, ...] = ()  # transfer ids of aborted producer requests: nothing more comes
    reset: bool = False  # empty the tiers before anything else
    allocated: tuple[int, ...] = ()  # engine block ids given to requests this step (saves may still read some)
    stopped: tuple[str, ...] = ()  # transfer ids of producer requests aborted or preempted: lend none of their blocks
    promotes: tuple[bytes, ...] = ()  # chain keys of disk chunks a plan left on cost: read into CPU when idle
