"""A consumer's side of the chunks of one transfer that land in its engine blocks (HBM to HBM).

The producer's reply names the chunk's engine blocks; the READs of every reply at hand (the
consumer waits for the rest of a turn of the producer's replies, ``ChunkReply.more``) go out
as one NIXL transfer, so runs of consecutive blocks coalesce across chunks (a window of chunks
costs about the descriptors of one, and the posting cost with them). Replies wait to be posted
until the caller needs one of them or :data:`POST_AT` have gathered: a READ per reply would pay
the posting cost per chunk (over ``cuda_ipc`` without UCX's mapping cache, a mapping of every
region of the producer's KV each time). The chunks sharing a READ each wait for it; the first to
see it done gives NIXL's handle back and times it (:func:`kvtier.pd.hbm.read_speed`).

A pull whose ``kv_transfer_params`` named P's blocks, from a producer this engine reached before
(its agent still known, its regions as its last handshake gave them: :func:`remember`), READs
them all at once, before P's handshake reply (:meth:`Landings.read_early`: posted on the
transfer's thread as soon as the hello went): the READ runs while P answers. A reply that names the same blocks takes that READ
(:meth:`Landings.add`) unless it failed already; one naming others is READ again once the
early READ settled (as is every chunk whose reply came after it failed), and a
chunk P answers otherwise (not lent) waits for it to settle too, so nothing else lands in the
blocks while it may still write there. P's KVSUM64 in each reply is checked on the blocks as
for any READ: blocks named wrongly cost time, never a wrong answer.

Every READ into engine blocks, early or batched, has a deadline (:mod:`kvtier.pd.consumer.fence`): one
that misses it fails the transfer, the producer's agent is torn down, and nothing more of the
transfer is READ or copied into its blocks (:meth:`Landings.settle_early` and :meth:`Landings.post`
raise); the fetch settles every READ before it returns (:meth:`Landings.settle`, :func:`discard`).

Block ids beyond the producer's engine KV (its handshake's ``num_blocks``) are never READ: a
reply naming one ends the transfer (:class:`~kvtier.pd.consumer.hello.PeerError`), parameters naming one
are not READ early. Only a handshake whose regions could be is remembered (the caller checks
them), and a READ with remembered regions that fails forgets them: the producer's next handshake
gives them again, and one bad reply leaves what an earlier good one gave in place.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from kvtier.jobs import Landed
from kvtier.pd.consumer.fence import Fence
from kvtier.pd.hbm import Landing, RegionSpan, blocks_problem, emulated, read_descriptors, read_speed
from kvtier.pd.consumer.hello import PeerError
from kvtier.pd.nixl import Agent, NixlError, Transfer
from kvtier.pd.protocol import ChunkReply
from kvtier.storage import ChunkBuffer

logger = logging.getLogger(__name__)
_told: set[str] = set()  # producers whose chunks were said to land HBM to HBM
_told_early: set[str] = set()  # ... whose named blocks were said to be READ before their reply
POST_AT = 16  # replies gathered before they are posted as one READ, unless one is needed sooner
Known = tuple[str, tuple[RegionSpan, ...], int, int]  # a producer's NIXL peer name, engine KV regions, CUDA device
# and blocks per region
_known: dict[tuple[str, str], Known] = {}  # (this agent, producer endpoint) -> as its last good handshake gave them


def remember(agent: Agent, endpoint: str, peer: str, theirs: tuple[RegionSpan, ...], device: int,
             num_blocks: int) -> None:
    """The producer at ``endpoint`` passed a handshake lending engine blocks: its agent is ``peer``
    and its engine KV ``theirs`` (regions that can be, of ``num_blocks`` blocks) on CUDA device
    ``device`` (what :meth:`Landings.read_early` uses)."""
    _known[(agent.name, endpoint)] = (peer, theirs, device, num_blocks)


def forget(agent: Agent, endpoint: str, known: Known) -> None:
    """A READ from the producer at ``endpoint`` with what it lent, ``known``, failed: forget that
    (not what a later handshake may have given since)."""
    if _known.get((agent.name, endpoint)) == known:
        del _known[(agent.name, endpoint)]


def read_early(agent: Agent, endpoint: str, mine: Landing, their_blocks: tuple[int, ...], counts: list[int],
               settle_s: float) -> Landings | None:
    """Landings from the producer at ``endpoint`` as its last handshake described it, their
    :meth:`~Landings.read_early` posted (arguments as there); None where ``agent`` no longer knows
    that producer's agent (it is kept while the producer's chunk server is up), ``their_blocks`` name
    blocks beyond its engine KV, or nothing was posted."""
    key = (agent.name, endpoint)
    entry = _known.get(key)
    if entry is not None and entry[0] not in agent.peer_names:  # that producer stopped: forget what it lent
        del _known[key]
        entry = None
    if entry is None or emulated(endpoint) or blocks_problem(their_blocks, entry[3]):
        return None
    landings = Landings(agent, endpoint, mine, *entry)
    return landings if landings.read_early(their_blocks, counts, settle_s) else None


def discard(arrived: Arrived, hbm: Landings | None, endpoint: str, timeout_s: float) -> None:
    """Release a chunk that will not be handed out: a READ into engine blocks settles through
    ``hbm``'s fence (:meth:`Fence.settle <kvtier.pd.consumer.fence.Fence.settle>`); one into a CPU-tier
    buffer that does not end in ``timeout_s`` keeps that buffer out of use for good."""
    transfer, buffer = arrived.transfer, arrived.buffer
    arrived.buffer = arrived.transfer = None
    if transfer is not None and hbm is not None and arrived.reply.blocks:
        hbm.fence.settle(transfer, timeout_s)
        return
    settled = transfer is None or transfer.settle(timeout_s)
    if transfer is not None and settled:
        transfer.release()
    if buffer is not None and settled:
        buffer.release()
    elif buffer is not None:
        logger.warning("kvtier P/D: a NIXL READ from %s did not end; its %d B buffer is kept out of use.",
                       endpoint, buffer.data.numel())


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
    ``theirs``, ``num_blocks`` blocks a region, on its CUDA device ``device``; this engine's is
    ``mine`` (with each chunk's blocks)."""

    def __init__(self, agent: Agent, endpoint: str, mine: Landing, peer: str, theirs: tuple[RegionSpan, ...],
                 device: int, num_blocks: int):
        self.agent, self.peer, self.endpoint = agent, peer, endpoint
        self.mine, self.theirs, self.device, self.num_blocks = mine, theirs, device, num_blocks
        self.block_bytes = sum(r.block_bytes for r in mine.regions)
        self.fence = Fence(agent, peer, endpoint)  # every READ posted here, with its deadline
        self._unposted: list[Arrived] = []
        self._posting_s = agent.post_s  # the agent's posting time when this transfer began
        self.reads = 0  # READs posted
        self.chunks, self.read_s = 0, 0.0
        self._early: Transfer | None = None  # the READ posted before P's reply (read_early)
        self._early_blocks: dict[int, tuple[int, ...]] = {}  # chunk index -> P's blocks that READ took
        self._early_s, self._settle_s = 0.0, 0.0  # perf_counter s it was posted; longest wait for it to settle
        self.early_taken = 0  # chunks whose reply named the blocks the early READ took

    def matches(self, peer: str, theirs: tuple[RegionSpan, ...], device: int, num_blocks: int) -> bool:
        """Whether P's handshake reply describes the same producer memory as these Landings."""
        return self.known == (peer, theirs, device, num_blocks)

    @property
    def known(self) -> Known:
        """The producer's memory as these Landings READ it."""
        return self.peer, self.theirs, self.device, self.num_blocks

    def read_early(self, their_blocks: tuple[int, ...], counts: list[int], settle_s: float) -> bool:
        """Post one READ of every chunk (``counts``: each chunk's blocks, in order) from P's blocks
        ``their_blocks`` (the first chunk's first on) into this engine's, before P's reply names
        them, on this thread (it would wait for P's reply meanwhile); ``settle_s``: its deadline,
        after its posting (``pd_timeout_ms``). False if none could be posted."""
        mine: list[int] = []
        theirs: list[int] = []
        start = 0
        for index, count in enumerate(counts):
            own, named = self.mine.block_ids[index], their_blocks[start : start + count]
            start += count
            if own is not None and len(own) == count == len(named):
                mine.extend(own)
                theirs.extend(named)
                self._early_blocks[index] = named
        self._early = self._read(mine, theirs, here=True) if mine else None  # here: the caller waits for P meanwhile
        if self._early is None:
            return False
        self._early_s, self._settle_s = time.perf_counter(), settle_s
        logger.debug("kvtier P/D: %d blocks READ from %s before its reply, as its parameters named them", len(mine),
                     self.endpoint)
        if self.endpoint not in _told_early:
            _told_early.add(self.endpoint)
            logger.info("kvtier P/D: reading the blocks %s's parameters name before its reply.", self.endpoint)
        return True

    def settle_early(self, index: int | None = None) -> None:
        """Wait until the early READ no longer runs (its blocks may take other bytes then; ``index``:
        only if it READ into chunk ``index``'s) and give its handle back. Raises :class:`PeerError`
        if it missed its deadline (:mod:`kvtier.pd.consumer.fence`): nothing else may land in its blocks."""
        early = self._early
        if early is None or (index is not None and index not in self._early_blocks):
            return
        if not self.fence.settle(early, self._settle_s):
            raise PeerError(f"{self.endpoint}: the READ of the blocks its parameters named did not end in time")

    def settle(self, timeout_s: float) -> bool:
        """Wait until no READ of these landings runs, each up to its deadline, ``timeout_s`` after its
        posting (:meth:`Fence.settle <kvtier.pd.consumer.fence.Fence.settle>`): the transfer ends, its blocks
        are checked or handed back next. False if one missed it. Never raises."""
        return self.fence.settle(None, timeout_s)

    def wants(self, index: int) -> bool:
        """Whether to ask for chunk ``index`` as engine blocks (not where the path was found emulated)."""
        return self.mine.block_ids[index] is not None and not emulated(self.endpoint)

    def add(self, arrived: Arrived) -> None:
        """A reply naming engine blocks: read by the early READ where it took those blocks, else by
        the next :meth:`post`. Raises :class:`PeerError` if it names blocks beyond P's engine KV."""
        if problem := blocks_problem(arrived.reply.blocks, self.num_blocks):
            raise PeerError(f"{self.endpoint} named chunk {arrived.reply.index}'s engine blocks wrongly: {problem}")
        index, early = arrived.reply.index, self._early  # (an early READ already failed: READ again)
        state = early.state() if early is not None and self._early_blocks.get(index) == tuple(arrived.reply.blocks) else ""
        if state == "ERR":
            forget(self.agent, self.endpoint, self.known)
        if state not in ("", "ERR"):
            arrived.transfer, arrived.started_s = early, self._early_s
            self.early_taken += 1
            return
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
        if self.fence.broken:  # a READ of this transfer missed its deadline: nothing more is READ
            raise PeerError(f"{self.endpoint}: a READ of this transfer did not end in time")
        self.settle_early()  # a chunk named otherwise: read again once the early READ cannot write there
        batch, self._unposted = sorted(self._unposted, key=lambda a: a.reply.index), []
        mine, theirs, posted = [], [], []
        for arrived in batch:
            own = self.mine.block_ids[arrived.reply.index]
            if own is not None and len(own) == len(arrived.reply.blocks):
                mine.extend(own)
                theirs.extend(arrived.reply.blocks)
                posted.append(arrived)
        if not posted or (transfer := self._read(mine, theirs)) is None:
            return
        now = time.perf_counter()
        for arrived in posted:
            arrived.transfer, arrived.started_s = transfer, now

    def _read(self, mine: list[int], theirs: list[int], here: bool = False) -> Transfer | None:
        """One READ of P's blocks ``theirs`` into this engine's ``mine`` (``here``: posted on this
        thread, see :meth:`Agent.read <kvtier.pd.nixl.Agent.read>`), tracked by the fence; None if
        no descriptors pair them. One NIXL refuses is returned all the same, its state ``ERR``."""
        try:
            local, remote = read_descriptors(self.mine.regions, self.theirs, mine, theirs)
        except ValueError:
            return None
        transfer = self.agent.read(self.peer, local, remote, (self.mine.kind, self.mine.device, self.device), here)
        self.reads += 1
        return self.fence.track(transfer)

    def finish(self, index: int, arrived: Arrived, timeout_s: float, cancelled: Callable[[], bool],
               after: Arrived | None = None) -> Landed:
        """Wait for chunk ``index``'s READ, up to its deadline, ``timeout_s`` after its posting (or take
        P's word that it WROTE the chunk into the blocks this engine named); raises :class:`NixlError`
        (the caller discards ``arrived``). ``after``: the next chunk's reply, if here (it landed too
        when it shares the READ, or was WRITTEN)."""
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
        try:
            self.fence.wait(transfer, timeout_s, cancelled)
        except NixlError:
            if transfer.state() == "ERR":  # not a timeout or an abort: the next handshake gives P's memory again
                forget(self.agent, self.endpoint, self.known)
            raise
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
                         "for replies %.1f, posting READs %.1f, waiting for READs %.1f; %d READ before P's reply",
                         transfer_id, self.endpoint, self.chunks, self.reads, handshake_s * 1e3, reply_s * 1e3,
                         (self.agent.post_s - self._posting_s) * 1e3, self.read_s * 1e3, self.early_taken)
