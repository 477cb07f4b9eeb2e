"""Check chunks that a P/D transfer wrote straight into the engine's blocks (HBM to HBM).

The producer sends the KVSUM64 its save computed over the chunk's payload (the blocks read
region-major). Here the same blocks are gathered into a scratch chunk on the engine's device by
a copy kernel that computes KVSUM64 while it copies: on a GPU one pass at HBM speed (a 32 MiB
chunk in tens of microseconds), no host round trip of the bytes. A mismatch means the blocks
are not what the producer computed (a torn or late READ, a reused block, a bit flip).
"""

from __future__ import annotations

import logging
import time

import torch

from kvtier import codec
from kvtier.layout import Layout
from kvtier.ops import backend_names, checksums_in_kernel, pick_backend
from kvtier.ops.checksum import as_unsigned, payload_checksum
from kvtier.ops.span import ChunkSpan

logger = logging.getLogger(__name__)


class LandedCheck:
    """KVSUM64 of a chunk's engine blocks. ``chunk_blocks``: blocks of a whole chunk (the
    scratch is sized for it, allocated on first use: ``codec.chunk_bytes`` on the layout's device)."""

    def __init__(self, layout: Layout, chunk_blocks: int):
        self.layout = layout
        self.chunk_blocks = chunk_blocks
        kernels = ("cuda", "triton") if layout.device.type == "cuda" else ("cpu",)
        name = next((n for n in kernels if n in backend_names()), "torch")
        self.in_kernel = checksums_in_kernel(name)
        self._gather = pick_backend(layout, name)[0]
        # The GPU kernels copy with a bounded grid, so a reload leaves the model's kernels room;
        # a check is one short pass over the device's own memory: every SM may take part.
        self._kw = {"max_ctas": torch.cuda.get_device_properties(layout.device).multi_processor_count} \
            if name in ("cuda", "triton") else {}
        self.check_s = 0.0  # seconds spent checking, since start
        self._scratch: torch.Tensor | None = None
        self._sums = torch.zeros(1, dtype=torch.int64, device=layout.device)

    def checksum(self, block_ids: torch.Tensor, num_blocks: int) -> int:
        """KVSUM64 (unsigned) of blocks ``block_ids`` (``int64 [num_blocks]`` on the layout's
        device) as chunk payload. Runs on the current stream and waits for it."""
        if self._scratch is None:
            self._scratch = torch.empty(codec.chunk_bytes(self.layout, self.chunk_blocks), dtype=torch.uint8,
                                        device=self.layout.device)
        buffer = self._scratch[: codec.chunk_bytes(self.layout, num_blocks)]
        span = ChunkSpan(buffer, num_blocks, 0, block_ids)
        begin = time.perf_counter()
        try:
            if self.in_kernel:
                self._gather(self.layout, [span], checksums_out=self._sums, **self._kw)
                return as_unsigned(self._sums.cpu())[0]
            self._gather(self.layout, [span])
            return payload_checksum(buffer[codec.HEADER_BYTES:])
        finally:
            self.check_s += time.perf_counter() - begin

    def intact(self, block_ids: torch.Tensor, num_blocks: int, expected: int, what: str) -> bool:
        """Whether the blocks hold the chunk whose KVSUM64 is ``expected``; if not, one line names
        ``what`` (the chunk, its transfer and producer)."""
        if self.checksum(block_ids, num_blocks) == expected:
            return True
        logger.warning("kvtier P/D: %s arrived in the engine's blocks with another KVSUM64 than the producer "
                       "saved; recomputing from there.", what)
        return False
