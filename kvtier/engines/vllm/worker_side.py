"""Worker half of the vLLM connector: one :class:`TierWorker` per worker process, and on rank 0 the lookup server."""

from __future__ import annotations

import logging

import torch

from kvtier.config import KvtierConfig
from kvtier.layout import build_layout
from kvtier.lookup import LookupServer
from kvtier.storage import ChunkStore, StoreConfig
from kvtier.jobs import LoadJob, SaveJob
from kvtier.transfer import TierWorker

logger = logging.getLogger(__name__)


class WorkerSide:
    """Owns this worker's store, transfer worker and (rank 0) lookup server; closes all of them."""

    def __init__(self, config: KvtierConfig, model: str, block_size: int, num_blocks: int, endpoint: str,
                 rank: int, world_size: int):
        self.config = config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.rank = rank
        self.world_size = world_size
        self.endpoint = endpoint
        self.transfers: TierWorker | None = None
        self.store: ChunkStore | None = None
        self.server: LookupServer | None = None
        self._failed: set[int] = set()  # failed block ids, reported with the same step's finished loads

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = build_layout(kv_caches, self.block_size, self.num_blocks, model=self.model,
                              tp_rank=self.rank, tp_size=self.world_size)
        disk_path = self.config.disk_path
        if disk_path and self.world_size > 1:
            disk_path = f"{disk_path}/rank{self.rank}"
        self.store = ChunkStore(StoreConfig(
            cpu_bytes=self.config.cpu_bytes, disk_path=disk_path, disk_bytes=self.config.disk_bytes,
            namespace=layout.fingerprint.hex(), worker_id=self.rank, world_size=self.world_size,
        ))
        self.transfers = TierWorker(layout, self.store, self.config.chunk_tokens // self.block_size)
        if self.rank == 0:
            self.server = LookupServer(self.endpoint, self.transfers.prefix_tiers)
        logger.info("kvtier: %d regions, %d B per block, chunk of %d tokens; lookup at %s",
                    len(layout.regions), layout.bytes_per_block, self.config.chunk_tokens, self.endpoint)

    def start_loads(self, jobs: tuple[LoadJob, ...]) -> None:
        for job in jobs:
            self.transfers.submit_load(job)

    def save(self, jobs: tuple[SaveJob, ...]) -> None:
        if jobs:
            self.transfers.save(list(jobs))

    def finished_loads(self) -> set[str]:
        if self.transfers is None:
            return set()
        req_ids, failed = self.transfers.take_finished()
        self._failed |= failed
        return req_ids

    def failed_blocks(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.transfers is not None:
            self.transfers.close()
        if self.store is not None:
            self.store.close()
        self.server = self.transfers = self.store = None
