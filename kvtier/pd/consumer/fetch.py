"""A decode engine's side of a transfer: fetch chunks from one producer rank's chunk server.

One DEALER socket per transfer (a timed-out transfer's late replies can never reach the next;
CURVE with a secret, :mod:`kvtier.pd.channel`), a handshake that compares layouts (each hello
with a fresh nonce, which P's reply must echo and every later message carries), then a window
of fetches in flight: while the caller verifies and scatters chunk ``i``, chunks ``i+1 …`` are
on the wire. Any failure raises :class:`PeerError` after the chunks that did arrive were yielded.

Over NIXL the replies carry addresses instead of payloads: as each arrives, a buffer of this
engine's CPU tier (registered with NIXL) is allocated and a READ posted into it; a chunk is yielded
once its READ is done and its MAC checked. Buffers and READs not handed to the caller are settled
and released when the transfer ends, however it ends: a READ into engine blocks before it returns.

HBM to HBM (a :class:`Landing` given): where P still holds the request's engine blocks, its replies
name them and D READs them straight into the engine blocks the caller named (:mod:`kvtier.pd.hbm`);
once P lends, the rest is asked for at once and all replies read by one READ. A pull's hello
carries its first fetches (:func:`kvtier.pd.consumer.hello.first_fetches`): P answers them at once when
it lends the transfer, so the chunks' replies follow the handshake's without another round
trip; blocks P's params named are READ while P answers the hello. The caller gets a :class:`Landed`
with the KVSUM64 to check the blocks against (:mod:`kvtier.pd.consumer.landing`; each READ's deadline:
:mod:`kvtier.pd.consumer.fence`). A push (D asked first) is answered a step's chunks at a time, READ as one
(``pd_hbm_push`` "read"), or WRITTEN by P into the blocks each fetch names ("write"; D's NIXL
metadata in a second hello, once P's reply checked out); one ending with such fetches unanswered waits
up to twice ``timeout_ms`` (P's WRITE deadline, the same setting on both engines: :mod:`kvtier.pd.producer.writes`)
for P's word that none of its WRITEs still runs. Fetches and replies travel in batches.

Which of these a transfer takes is its route (:mod:`kvtier.pd.route`), settled at the handshake
and followed by the :class:`~kvtier.pd.route.Course` through its stages; the socket's traffic is
:class:`~kvtier.pd.consumer.connection.Connection`'s."""

from __future__ import annotations

import time
from typing import Iterator

import zmq

from kvtier.jobs import Landed
from kvtier.pd import faults
from kvtier.pd.channel import connect_dealer
from kvtier.pd.consumer.connection import Connection, Consumer, FetchSpec
from kvtier.pd.consumer.hello import PeerError, first_fetches, introduce, new_nonce, push_hello, say_transport
from kvtier.pd.consumer.landing import Landings, read_early, remember
from kvtier.pd.consumer.probe import direct_path
from kvtier.pd.hbm import RegionSpan, emulated
from kvtier.pd.protocol import VERSION, Release
from kvtier.pd.route import PushMode, Stage
from kvtier.storage import ChunkBuffer

__all__ = ["Consumer", "FetchSpec", "PeerError", "PushMode", "fetch_chunks"]


def fetch_chunks(consumer: Consumer, spec: FetchSpec) -> Iterator[ChunkBuffer | Landed]:
    """Yield the chunks of ``spec`` in order, each in a fresh buffer from ``consumer.allocate`` that
    the caller owns, or landed in the engine blocks ``spec.landing`` names (a :class:`Landed`).
    P is told it is done however it ends."""
    begin = time.perf_counter()
    endpoint, items, wait, landing, nixl = spec.endpoint, spec.items, spec.wait, spec.landing, consumer.nixl
    timeout_ms = consumer.timeout_ms
    socket = connect_dealer(endpoint, consumer.secret, max(map(consumer.chunk_bytes, (n for _, n in items))) + (64 << 10))
    peer = Connection(socket, consumer, spec)
    course = peer.course
    early = None  # the READ of the blocks P's params named, posted while P answers the hello (pull)
    try:
        peer.nonce, hbm = new_nonce(), nixl is not None and landing is not None and not emulated(endpoint)  # offered
        first = (first_fetches(spec.transfer_id, items, landing, consumer.block_size, peer.nonce, endpoint)
                 if hbm and not wait else ())
        transports = ("nixl", "zmq") if nixl is not None else consumer.hello.transports
        hello = introduce(consumer.hello, nonce=peer.nonce, transports=transports, hbm=hbm,
                          transfer_id=spec.transfer_id, fetches=first,
                          num_blocks=landing.num_blocks if landing is not None else 0)
        peer.send(hello)  # then, while P answers, this thread posts the READ of the blocks P's params named
        if hbm and not wait and spec.producer_blocks:
            early = read_early(nixl, endpoint, landing, spec.producer_blocks, [n for _, n in items], timeout_ms / 1000)
        reply = peer.hello(hello, sent=True)
        while course.answered(nixl=reply.transport == "nixl" and nixl is not None, regions=bool(reply.regions)):
            hello = push_hello(hello, nixl.metadata(), landing)  # a fresh nonce: every later message carries it
            reply = peer.hello(hello)  # P passed the handshake: only now does it learn how to reach us
        if course.route.nixl:
            peer.use_nixl(nixl, reply.nixl)
            remote = tuple(RegionSpan(*r) for r in reply.regions)  # checked: they can be (check_reply)
            direct = course.route.hbm and direct_path(nixl, peer.nixl_peer, endpoint, landing, remote, reply.device,
                                                      timeout_ms)
            if course.judged(direct, reply.lending).hbm:
                known = (peer.nixl_peer, remote, reply.device, reply.num_blocks)
                same = early is not None and reply.lending and early.matches(*known)
                peer.hbm = early if same else Landings(nixl, endpoint, landing, *known)
                remember(nixl, endpoint, *known)
        if early is not None and peer.hbm is not early:
            early.settle_early()  # P does not lend them now, or changed: what that READ wrote goes unused
        if reply.lending and hello.fetches:  # P answers the fetches the hello carried, naming its engine blocks
            if peer.hbm is None:
                raise PeerError(f"{endpoint} lends engine blocks this engine cannot READ (KV regions differ)")
            peer.sent, peer.asked = len(hello.fetches), set(range(len(hello.fetches)))
        peer.handshake_s = time.perf_counter() - begin
        say_transport(endpoint, course.route)
        for index in range(len(items)):
            peer.fetch_until(index + course.window())
            yield faults.corrupt(peer.chunk(index), landing, index)  # (KVTIER_PD_FAULTS, in fault soaks)
        course.landed()
    finally:  # no READ into engine blocks runs past here (kvtier.pd.consumer.fence): P may reuse its blocks, vLLM ours
        if course.stage is not Stage.LANDED:
            course.failed()
        for landings in {early, peer.hbm} - {None}:
            landings.settle(timeout_ms / 1000)
        peer.close()
        if peer.hbm is not None:
            peer.hbm.log(spec.transfer_id, peer.reply_s, peer.handshake_s)
        try:
            answer = course.released(bool(peer.named))  # a producer silent for the timeout is gone
            peer.send(Release(VERSION, spec.transfer_id, answer=answer, nonce=peer.nonce))
            if answer:  # P might still WRITE into blocks this engine will now recompute: wait for its word
                peer.settle_writes()
        except zmq.ZMQError:
            pass
        socket.close()
