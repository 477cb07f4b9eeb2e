"""A consumer's side of the chunks of one transfer that land in its engine blocks (HBM to HBM).

The producer's reply names the chunk's engine blocks; the READs of every reply at hand (the
consumer waits for the rest of a turn of the producer's replies, ``ChunkReply.more``) go out
as one NIXL transfer, so runs of consecutive blocks coalesce across chunks (a window of chunks
costs about the descriptors of one, and the posting cost with them). Replies wait to be posted
until the caller needs one of them or :data:`POST_AT` have gathered: a READ per reply would pay
the posting cost per chunk (over ``cuda_ipc`` without UCX's mapping cache, a mapping of every
region of the producer's KV each time). The chunks sharing a READ each wait for it; the first to
see it done gives NIXL's handle back and times it (:func:`kvtier.pd.hbm.read_speed`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from kvtier.jobs import Landed
from kvtier.pd.hbm import Landing, RegionSpan, emulated, read_descriptors, read_speed
from kvtier.pd.nixl import Agent, NixlError, Transfer
from kvtier.pd.protocol import ChunkReply
from kvtier.storage import ChunkBuffer

logger = logging.getLogger(__name__)
_told: set[str] = set()  # producers whose chunks were said to land HBM to HBM
POST_AT = 16  # replies gathered before they are posted as one READ, unless one is needed sooner


@dataclass(slots=True)
class Arrived:
    """A chunk reply ahead of its turn. ZMQ: its ``payload`` frame. NIXL: the ``buffer`` being
    read into by ``transfer`` (HBM: the engine blocks the reply names, read by ``transfer``,
    posted at ``started_s``), and the ``tag`` and ``body`` whose MAC covers the bytes read."""

    reply: ChunkReply
    payload: zmq.Frame | None = None
    buffer: ChunkBuffer | None = None
    transfer: Transfer | None = None
    tag: bytes = b""
    body: bytes = b""
    started_s: float = 0.0  # perf_counter s


class Landings:
    """``agent`` reaches NIXL peer ``peer`` (the producer at ``endpoint``): its engine KV is
    ``theirs`` on its CUDA device ``device``; this engine's is ``mine`` (with each chunk's blocks)."""

    def __init__(self, agent: Agent, peer: str, endpoint: str, mine: Landing, theirs: tuple[RegionSpan, ...],
                 device: int):
        self.agent, self.peer, self.endpoint = agent, peer, endpoint
        self.mine, self.theirs, self.device = mine, theirs, device
        self.block_bytes = sum(r.block_bytes for r in mine.regions)
        self._unposted: list[Arrived] = []
        self._posting_s = agent.post_s  # the agent's posting time when this transfer began
        self.reads = 0  # READs posted
        self.chunks, self.read_s = 0, 0.0

    def wants(self, index: int) -> bool:
        """Whether to ask for chunk ``index`` as engine blocks (not where the path was found emulated)."""
        return self.mine.block_ids[index] is not None and not emulated(self.endpoint)

    def add(self, arrived: Arrived) -> None:
        """A reply naming engine blocks: READ by the next :meth:`post`."""
        self._unposted.append(arrived)

    def unposted(self, index: int) -> bool:
        """Whether chunk ``index``'s reply is added and its READ not posted yet."""
        return any(a.reply.index == index for a in self._unposted)

    def post(self, needed: int) -> None:
        """One READ for every reply added since the last post, if chunk ``needed`` is among them
        or :data:`POST_AT` have gathered (a chunk whose READ could not be posted fails when its
        turn comes)."""
        if len(self._unposted) < POST_AT and not self.unposted(needed):
            return
        batch, self._unposted = sorted(self._unposted, key=lambda a: a.reply.index), []
        mine, theirs, posted = [], [], []
        for arrived in batch:
            own = self.mine.block_ids[arrived.reply.index]
            if own is not None and len(own) == len(arrived.reply.blocks):
                mine.extend(own)
                theirs.extend(arrived.reply.blocks)
                posted.append(arrived)
        if not posted:
            return
        try:
            local, remote = read_descriptors(self.mine.regions, self.theirs, mine, theirs)
            transfer = self.agent.read(self.peer, local, remote, (self.mine.kind, self.mine.device, self.device))
        except (NixlError, ValueError):
            return
        self.reads += 1
        now = time.perf_counter()
        for arrived in posted:
            arrived.transfer, arrived.started_s = transfer, now

    def finish(self, index: int, arrived: Arrived, timeout_s: float, cancelled: Callable[[], bool],
               after: Arrived | None = None) -> Landed:
        """Wait for chunk ``index``'s READ (or take P's word that it WROTE the chunk into the blocks
        this engine named); raises :class:`NixlError` (the caller discards ``arrived``). ``after``:
        the next chunk's reply, if here (it landed too when it shares the READ, or was WRITTEN)."""
        nbytes = len(arrived.reply.blocks) * self.block_bytes
        follows = after is not None and after.reply.status == "ok" and bool(after.reply.blocks) and (
            after.transfer is not None and after.transfer is arrived.transfer or after.reply.written)
        if arrived.reply.written:
            if tuple(arrived.reply.blocks) != tuple(self.mine.block_ids[index] or ()):
                raise NixlError(f"chunk {index} was written into blocks {arrived.reply.blocks[:4]}…, not those named")
            self.chunks += 1
            self._tell()
            return Landed(arrived.reply.checksum, nbytes, follows)
        transfer = arrived.transfer
        if transfer is None:
            raise NixlError(f"{len(arrived.reply.blocks)} engine blocks named could not be read into this engine's")
        begin = time.perf_counter()
        transfer.wait(timeout_s, cancelled)
        self.read_s += time.perf_counter() - begin
        self.chunks += 1
        if not transfer.released:  # the first of the chunks sharing this READ
            transfer.release()
            read_speed(self.endpoint, self.mine.kind, transfer.nbytes, time.perf_counter() - arrived.started_s)
        self._tell()
        return Landed(arrived.reply.checksum, nbytes, follows)

    def _tell(self) -> None:
        if self.endpoint not in _told:
            _told.add(self.endpoint)
            logger.info("kvtier P/D: chunks from %s land HBM to HBM (engine blocks to engine blocks).", self.endpoint)

    def log(self, transfer_id: str, reply_s: float, handshake_s: float = 0.0) -> None:
        """One debug line on where the transfer's time went (posting: this engine's, all transfers meanwhile;
        ``handshake_s``: from connecting to P to the first fetch)."""
        if self.chunks:
            logger.debug("kvtier P/D: transfer %s from %s: %d chunks landed by %d READs; ms handshake %.1f, waiting "
                         "for replies %.1f, posting READs %.1f, waiting for READs %.1f", transfer_id, self.endpoint,
                         self.chunks, self.reads, handshake_s * 1e3, reply_s * 1e3,
                         (self.agent.post_s - self._posting_s) * 1e3, self.read_s * 1e3)
