"""A chunk server's engine blocks, HBM to HBM (the producer's side of :mod:`kvtier.pd.hbm`).

A consumer whose hello offered it (``Hello.hbm``, same layout fingerprint) gets this rank's
engine KV regions in the handshake reply. Its pull fetches for a transfer under a lease
(:mod:`kvtier.pd.producer.leases`) are answered with the chunk's engine block ids and its KVSUM64, which
the consumer READs and checks itself. A push consumer that also gave its own
engine KV (its second hello, after this server's reply checked out) and names its blocks in each
fetch (``Fetch.blocks``) is written into instead: from the running request's blocks, or from the
lease that follows it, as soon as the chunk's checksum is known: taken from its blocks as its
step ended (:mod:`kvtier.pd.producer.sums`), else its stored copy's; the chunks ready in one turn of the
server share one WRITE (:class:`kvtier.pd.producer.writes.PeerWrites`, which gives each a deadline). A
pull fetch is answered with the blocks as soon, too, from the running request's or the lease's:
the consumer READs them.
The replies of one turn go out together, as few :class:`~kvtier.pd.protocol.ChunkReplies` as
:data:`~kvtier.pd.protocol.MAX_BATCH` allows, each reply saying how many more follow
(``ChunkReply.more``), so the consumer READs a step's chunks as one (posting a READ costs a
mapping of P's KV).

Used by the chunk server's thread only.
"""

from __future__ import annotations

from typing import Callable

from kvtier import codec
from kvtier.pd.hbm import EngineBlocks, RegionSpan, compatible, emulated
from kvtier.pd.nixl import Agent
from kvtier.pd.protocol import VERSION, ChunkReply, Fetch, Hello, reply_batches
from kvtier.pd.producer.writes import BlockWrite, PeerWrites
from kvtier.storage import ChunkBuffer
from kvtier.timeline import mark

Send = Callable[..., None]  # (identity, reply, payload=None) -> None: the server's _send


class HbmServing:
    """``send``: how the server replies; ``writes``: its WRITEs in flight."""

    def __init__(self, send: Send, writes: PeerWrites):
        self.engine: EngineBlocks | None = None  # set once the engine KV is registered with NIXL
        self._send = send
        self._writes = writes
        self._readers: set[bytes] = set()  # identities given the engine KV regions
        self._targets: dict[bytes, tuple[str, tuple[RegionSpan, ...], int]] = {}  # identity -> NIXL peer, its
        # engine KV regions, its CUDA device: a push consumer whose blocks may be written into
        self._batch: dict[bytes, list[BlockWrite]] = {}  # chunks to WRITE at the end of this turn, per peer
        self._replies: dict[bytes, tuple[str, list[ChunkReply]]] = {}  # identity -> (transfer id, replies naming
        # engine blocks), sent at the end of this turn
        self.lent_total = 0  # chunks answered with engine blocks (pull) since start
        self.lease_waits = 0  # looks at fetches that found their transfer's lease not begun yet

    def hello(self, identity: bytes, hello: Hello, same_layout: bool, writer: str | None,
              ) -> tuple[tuple[tuple[int, int, int], ...], int, bool]:
        """Note what a consumer's hello offers (``writer``: its NIXL peer name when it gave its
        metadata); the regions and device to put in the reply (empty: no HBM to HBM), and whether
        the transfer it names is lent now (its chunks may all be asked for at once)."""
        engine = self.engine
        if not (hello.hbm and engine is not None and same_layout):
            self.forget(identity)
            return (), 0, False
        self._readers.add(identity)
        theirs = tuple(RegionSpan(*r) for r in hello.regions)
        if writer is not None and theirs and compatible(engine.regions, theirs):
            self._targets[identity] = (writer, theirs, hello.device)
        regions = tuple((r.base, r.stride, r.block_bytes) for r in engine.regions)
        return regions, engine.device, engine.leases.holds(hello.transfer_id)  # "": no transfer, no lease

    @staticmethod
    def carried(hello: Hello) -> list[Fetch]:
        """The pull fetches a hello carries, of the transfer it names and bound to its nonce
        (answered at once, each as if it came alone, when the reply says P lends that transfer's blocks)."""
        return [f for f in hello.fetches
                if f.transfer_id == hello.transfer_id and f.nonce == hello.nonce and not f.wait and not f.blocks]

    def forget(self, identity: bytes) -> None:
        """The peer's connection ended (released, or gone quiet)."""
        self._readers.discard(identity)
        self._targets.pop(identity, None)

    def waits_for_lease(self, identity: bytes, fetch: Fetch) -> bool:
        """Whether a pull fetch should wait for its transfer's lease, about to begin."""
        if not (fetch.hbm and not fetch.blocks and identity in self._readers):
            return False
        waits = self.engine.leases.expected(fetch.transfer_id)
        self.lease_waits += waits
        return waits

    def answer(self, identity: bytes, fetch: Fetch, buffer: ChunkBuffer) -> bool:
        """Answer a stored chunk from the engine's blocks (takes ``buffer`` then: the stored copy
        told only the checksum, or is the fallback should the WRITE fail): write it into the
        blocks a push fetch named, or lend it to a pull fetch. False to serve it otherwise."""
        if not fetch.hbm or identity not in self._readers:
            return False
        engine = self.engine
        try:
            header = codec.read_header(buffer.data)
        except codec.ChunkError:
            return False  # sent as it is: the consumer's check refuses it
        num_blocks = header.payload_bytes // engine.bytes_per_block
        if header.checksum_kind != codec.KVSUM64 or num_blocks != fetch.num_blocks:
            return False
        return self._from_blocks(identity, fetch, header.checksum, buffer)

    def answer_early(self, identity: bytes, fetch: Fetch) -> bool:
        """Answer a chunk from the engine's blocks, as :meth:`answer` does, if its checksum was
        taken as its step ended (:mod:`kvtier.pd.producer.sums`), whether or not its copy is stored (no
        look-up in the store). A WRITE of it that fails is answered from the stored copy once
        there (:class:`~kvtier.pd.producer.writes.PeerWrites`)."""
        engine = self.engine
        if not fetch.hbm or identity not in self._readers or engine is None or engine.sums is None:
            return False
        checksum = engine.sums.get(fetch.transfer_id, fetch.key, fetch.num_blocks)
        return checksum is not None and self._from_blocks(identity, fetch, checksum, None)

    def _from_blocks(self, identity: bytes, fetch: Fetch, checksum: int, buffer: ChunkBuffer | None) -> bool:
        target = self._targets.get(identity) if fetch.blocks else None
        if fetch.blocks and (target is None or len(fetch.blocks) != fetch.num_blocks or emulated(target[0])):
            return False
        blocks = self.engine.leases.blocks(fetch.transfer_id, fetch.key, fetch.num_blocks)
        if blocks is None:
            return False
        if target is not None:
            self._batch.setdefault(identity, []).append(BlockWrite(identity, fetch, buffer, blocks, checksum))
            return True
        self.lent_total += 1
        self._replies.setdefault(identity, (fetch.transfer_id, []))[1].append(
            ChunkReply(VERSION, fetch.index, "ok", blocks=blocks, checksum=checksum))
        if buffer is not None:
            buffer.release()
        return True

    def sums_came(self) -> set[bytes]:
        """Chain keys of chunks just computed whose checksums came in (their waiting fetches may be
        answered now)."""
        return set() if self.engine is None or self.engine.sums is None else self.engine.sums.poll()

    @property
    def sums_pending(self) -> bool:
        """Checksums are being taken: the server should look again soon."""
        return self.engine is not None and self.engine.sums is not None and self.engine.sums.pending

    def flush(self, agent: Agent) -> None:
        """Send this turn's replies naming engine blocks, together, each with how many of them follow
        it, and post one WRITE per peer for the chunks gathered this turn. Never raises: a WRITE
        that cannot be posted (NIXL's or CUDA's error) sends its chunks otherwise
        (:meth:`PeerWrites.start_blocks <kvtier.pd.producer.writes.PeerWrites.start_blocks>`)."""
        replies_of, self._replies = self._replies, {}
        for identity, (transfer_id, replies) in replies_of.items():
            for message in reply_batches(replies):
                self._send(identity, message)
            mark(transfer_id, "lent")
        batch, self._batch = self._batch, {}
        for identity, chunks in batch.items():
            peer, theirs, device = self._targets.get(identity) or (None, (), 0)
            if peer is None:  # the peer left meanwhile
                for c in chunks:
                    if c.buffer is not None:
                        c.buffer.release()
                continue
            self._writes.start_blocks(agent, peer, self.engine, theirs, device, chunks)
