"""A chunk server's record of its consumers' handshakes: the hello nonces it saw, the nonce each
connection's later messages must carry, the connection that began each transfer (see the replay
paragraph of :mod:`kvtier.pd.protocol`).

A hello is taken once: its nonce is kept for twice :data:`~kvtier.pd.protocol.HELLO_WINDOW_S`
(a hello sent later than that from this host's clock is refused anyway), at most
:data:`MAX_NONCES` of them; past that, hellos are refused until old nonces age out. A connection
(a ZMQ routing identity) is bound to its latest hello's nonce and the engine ``num_blocks`` that
hello gave, until it releases the transfers it began or stays quiet for ``idle_s``; past
:data:`MAX_CONNECTIONS` bound, the quietest is forgotten (its later messages are refused, and its
consumer recomputes). A decode engine of more TP ranks than this one's engine reads each of this
rank's chunks from several of its ranks (each its share of the KV heads,
:mod:`kvtier.pd.consumer.gather`): a transfer then has that many readers, one connection each, and
ends with the last one's release. Each check returns why a message is refused, in words ("" if it
is not), and records nothing for a refused one.

Used by the chunk server's thread only.
"""

from __future__ import annotations

import hmac
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvtier.pd.hbm import RegionSpan, blocks_problem, region_problem
from kvtier.pd.protocol import HELLO_WINDOW_S, NONCE_BYTES, Fetch, Hello, Release

MAX_NONCES = 1 << 16  # hello nonces kept (each for 2 × HELLO_WINDOW_S): ~550 hellos a second, sustained
MAX_CONNECTIONS = 1 << 13  # connections bound at once
MAX_BEGUN = 8  # transfers one connection may begin (a decode engine's connection begins one)


@dataclass(slots=True)
class _Bound:
    """A connection's latest hello: its ``nonce``, the consumer's engine ``num_blocks``, the
    transfers the connection began, its last message (monotonic s), and how many of the consumer's
    ranks read each transfer (``readers``)."""

    nonce: bytes
    num_blocks: int
    last_s: float
    began: set[str] = field(default_factory=set)
    readers: int = 1


@dataclass(slots=True)
class _Readers:
    """A transfer's reading connections: those that began it and did not release it, how many in all
    may (``expected``) and how many did release it."""

    identities: set[bytes]
    expected: int
    released: int = 0


class Handshakes:
    """``idle_s``: how long a connection that sends nothing stays bound. ``tp_size``: this engine's TP
    ranks (a consumer of ``k`` times as many reads each transfer with ``k`` connections)."""

    def __init__(self, idle_s: float, tp_size: int = 1):
        self._idle_s, self._tp_size = idle_s, tp_size
        self._nonces: OrderedDict[bytes, float] = OrderedDict()  # nonce -> when its hello came (monotonic s)
        self._bound: OrderedDict[bytes, _Bound] = OrderedDict()  # identity -> its latest hello, quietest first
        self._began: dict[str, _Readers] = {}  # transfer id -> the connections whose hello or fetch named it

    def hello(self, identity: bytes, hello: Hello) -> str:
        """Check ``hello`` (a fresh nonce, sent within the window, regions that can be) and bind
        ``identity``'s later messages to it."""
        if len(hello.nonce) != NONCE_BYTES:
            return "a hello without a nonce"
        skew_s = hello.sent_ms / 1000 - time.time()
        if abs(skew_s) > HELLO_WINDOW_S:
            return (f"a hello sent {abs(skew_s):.0f} s {'after' if skew_s > 0 else 'before'} this host's clock "
                    f"(a replay, or clocks more than {HELLO_WINDOW_S:.0f} s apart)")
        now = time.monotonic()
        self.expire(now)
        if hello.nonce in self._nonces:
            return "a replayed hello (its nonce was seen already)"
        if len(self._nonces) >= MAX_NONCES:
            return f"more than {MAX_NONCES} hellos within {2 * HELLO_WINDOW_S:.0f} s"
        if problem := region_problem(tuple(RegionSpan(*r) for r in hello.regions), hello.num_blocks):
            return f"a hello whose {problem}"
        self._nonces[hello.nonce] = now
        bound = self._bound.pop(identity, None) or _Bound(hello.nonce, hello.num_blocks, now)
        bound.nonce, bound.num_blocks, bound.last_s = hello.nonce, hello.num_blocks, now
        bound.readers = max(1, hello.tp_size // self._tp_size)
        self._bound[identity] = bound
        if hello.transfer_id:
            self._begin(identity, bound, hello.transfer_id)
        while len(self._bound) > MAX_CONNECTIONS:
            self._unbind(next(iter(self._bound)))
        return ""

    def message(self, identity: bytes, nonce: bytes) -> str:
        """Check that a message carrying ``nonce`` comes from the connection whose latest hello had it."""
        bound = self._bound.get(identity)
        if bound is None:
            return "a message from a connection that sent no hello taken here (a replay, or one gone quiet)"
        if not hmac.compare_digest(nonce, bound.nonce):
            return "a message bound to another hello than its connection's latest (a replay)"
        bound.last_s = time.monotonic()
        self._bound.move_to_end(identity)
        return ""

    def fetch(self, identity: bytes, fetch: Fetch) -> str:
        """Check a fetch of a connection whose message passed :meth:`message`: its nonce, and the
        consumer's engine blocks it names (as many as its chunk's blocks, each one of the
        consumer's); the first naming its transfer begins it."""
        bound = self._bound[identity]
        if not hmac.compare_digest(fetch.nonce, bound.nonce):
            return f"a fetch of chunk {fetch.index} bound to another hello than its connection's latest (a replay)"
        if fetch.blocks and len(fetch.blocks) != fetch.num_blocks:
            return (f"chunk {fetch.index} of transfer {fetch.transfer_id} names {len(fetch.blocks)} engine blocks "
                    f"to write for a chunk of {fetch.num_blocks}")
        if fetch.blocks and (problem := blocks_problem(fetch.blocks, bound.num_blocks)):
            return (f"chunk {fetch.index} of transfer {fetch.transfer_id} names an engine block to write that "
                    f"cannot be: {problem}")
        self._begin(identity, bound, fetch.transfer_id)
        return ""

    def release(self, identity: bytes, release: Release) -> str:
        """Check a release: from the connection bound to its nonce, which began its transfer (see
        :meth:`still_read`)."""
        if problem := self.message(identity, release.nonce):
            return problem
        readers = self._began.get(release.transfer_id)
        if readers is None or identity not in readers.identities:
            return f"a release of transfer {release.transfer_id} from a connection that did not begin it"
        readers.identities.discard(identity)
        readers.released += 1
        if readers.released >= readers.expected:
            del self._began[release.transfer_id]
        bound = self._bound[identity]
        bound.began.discard(release.transfer_id)
        if not bound.began:  # one connection per transfer: it is done
            self._unbind(identity)
        return ""

    def expire(self, now: float | None = None) -> None:
        """Forget nonces past twice the window and connections quiet for ``idle_s`` (monotonic ``now``)."""
        now = time.monotonic() if now is None else now
        while self._nonces and now - next(iter(self._nonces.values())) > 2 * HELLO_WINDOW_S:
            self._nonces.popitem(last=False)
        while self._bound and now - next(iter(self._bound.values())).last_s > self._idle_s:
            self._unbind(next(iter(self._bound)))

    def still_read(self, transfer_id: str) -> bool:
        """Whether a consumer's connection still reads ``transfer_id`` or may yet release it (after a
        release: the transfer's blocks and chunks stay held for them)."""
        return transfer_id in self._began

    @property
    def bound(self) -> int:
        """Connections bound now (tests, stats)."""
        return len(self._bound)

    def _begin(self, identity: bytes, bound: _Bound, transfer_id: str) -> None:
        if transfer_id in bound.began or len(bound.began) >= MAX_BEGUN:
            return
        readers = self._began.setdefault(transfer_id, _Readers(set(), bound.readers))
        if len(readers.identities) + readers.released < readers.expected:
            readers.identities.add(identity)
            bound.began.add(transfer_id)

    def _unbind(self, identity: bytes) -> None:
        bound = self._bound.pop(identity, None)
        for transfer_id in bound.began if bound is not None else ():
            readers = self._began.get(transfer_id)
            if readers is not None:
                readers.identities.discard(identity)
                if not readers.identities:
                    del self._began[transfer_id]
