"""Replays on the P/D side channel, through real worker halves with a shared secret and real NIXL
over UCX on loopback (host memory registered as DRAM stands in for VRAM, as in ``test_pd_hbm.py``).

A captured hello replayed on a new connection is refused and gets no NIXL metadata; a decode
engine's release replayed from another connection (or sent by a connection that did not begin
the transfer) is refused, and P's lease, publish holds, lent buffers and waiting fetches stay; a
handshake reply to another hello is refused by D. With the secret the channel is ZMQ CURVE: a
peer without the chunk server's key cannot talk, and a wire tap sees nothing of the handshake."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import msgspec
import pytest
import torch
import zmq

from fuzzing import ask
from pd_workers import BLOCK, publish, prompt_keys, remote_job, tokens_of, wait_for
from test_pd_hbm import D_BLOCKS, P_BLOCKS, PROMPT, lend, wait_ended
from kvtier.codec import chunk_bytes
from kvtier.jobs import SaveJob
from kvtier.pd import nixl
from kvtier.pd.consumer import connection
from kvtier.pd.channel import bind_router, connect_dealer
from kvtier.pd.consumer.fetch import Consumer, FetchSpec, PeerError, fetch_chunks
from kvtier.pd.consumer.hello import introduce
from kvtier.pd.protocol import (
    VERSION, ChunkReply, Fetch, Fetches, Hello, HelloReply, Release, decode_reply, decode_request, encode, mac,
)

pytestmark = pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed: make test installs nixl-cu12")

SECRET = "replay-secret"
KEY = SECRET.encode()


@pytest.fixture
def transport() -> str:
    return "nixl"


def signed(message: msgspec.Struct, secret: bytes = KEY) -> list[bytes]:
    body = encode(message)
    return [mac(secret, body), body]


def capture(monkeypatch) -> list[tuple[msgspec.Struct, list[bytes]]]:
    """Every message D's transfers send from now on, as it went on the wire: (message, frames)."""
    sent = []
    send = connection.Connection.send

    def spy(peer, message):
        sent.append((message, signed(message, peer.secret)))
        send(peer, message)

    monkeypatch.setattr(connection.Connection, "send", spy)
    return sent


class Connection:
    """One connection to a chunk server, a CURVE client with the secret (the replayer got past the
    encryption: what is tested here is what the chunk server does with a replayed message)."""

    def __init__(self, endpoint: str):
        self.socket = connect_dealer(endpoint, KEY, 1 << 20)

    def ask(self, frames: list[bytes], timeout_ms: int = 2000) -> list[bytes]:
        self.socket.send_multipart(frames)
        assert self.socket.poll(timeout_ms), "the chunk server did not answer"
        return self.socket.recv_multipart()

    def close(self) -> None:
        self.socket.close(0)


def refused(frames: list[bytes], why: str) -> None:
    reply = decode_reply(frames[1])
    assert isinstance(reply, ChunkReply) and reply.status == "refused" and why in reply.error, reply


def test_a_captured_hello_replayed_on_a_new_connection_is_refused_and_gets_no_metadata(engines, monkeypatch, caplog):
    p, d = engines("p", 1, pd_secret=SECRET), engines("d", 2, pd_secret=SECRET)
    sent = capture(monkeypatch)
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p, "t1")
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set()  # its hello was answered with P's metadata: it READ P's blocks
    hello = next(frames for message, frames in sent if isinstance(message, Hello))
    server, metadata = p.side.chunk_server, p.side.nixl.metadata()
    rejected = server.rejected
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for _ in range(2):  # each time on a new connection
            connection = Connection(p.endpoint)
            reply = connection.ask(hello)
            connection.close()
            refused(reply, "replayed hello")
            assert metadata not in b"".join(reply)
    assert server.rejected == rejected + 2
    assert "replayed hello" in caplog.text and "127.0.0.1" in caplog.text  # the line names the peer
    fresh = introduce(decode_request(hello[1]))  # the control: the same hello, new nonce, sent now
    connection = Connection(p.endpoint)
    reply = decode_reply(connection.ask(signed(fresh))[1])
    connection.close()
    assert isinstance(reply, HelloReply) and reply.nixl == metadata and reply.nonce == fresh.nonce


def test_a_hello_sent_outside_the_window_is_refused(engines):
    p = engines("p", 1, pd_secret=SECRET)
    stale = msgspec.structs.replace(introduce(p.side._hello), sent_ms=int(time.time() * 1000) - 120_000)
    connection = Connection(p.endpoint)
    refused(connection.ask(signed(stale)), "120 s before this host's clock")
    ahead = msgspec.structs.replace(introduce(p.side._hello), sent_ms=int(time.time() * 1000) + 120_000)
    refused(connection.ask(signed(ahead)), "120 s after this host's clock")
    connection.close()


def test_a_release_from_another_connection_is_refused_and_changes_nothing(engines, monkeypatch, caplog):
    """While D pulls transfer t1 under P's lease, pulls t2 from P's CPU tier (P lends its buffers)
    and waits for t3 (not published yet), the release D will send for each, replayed ahead of it
    from a new connection, is refused, as are D's captured fetches of t2 (P would lend its
    buffers again); so is a release of t1 from a connection with a handshake of its own. P's
    lease, publish holds, lent buffers and waiting fetches stay until D's own releases, which are
    the very bytes replayed."""
    p, d = engines("p", 1, pd_secret=SECRET), engines("d", 2, pd_secret=SECRET, pd_timeout_ms=5000)
    sent = capture(monkeypatch)
    other, later = tokens_of(64, seed=9), tokens_of(64, seed=11)  # two full chunks each
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p, "t1")
    p.side.save((SaveJob("p-2", tuple(prompt_keys(other)[0]), tuple(range(30, 34)), publish="t2", final=True),))
    assert p.side.settle()
    kv, layout = d.side.engine_kv, d.side.transfers.layout
    full, full2 = prompt_keys(PROMPT)[0], prompt_keys(other)[0]
    consumer = Consumer(d.side._hello, 2000, KEY, allocate=lambda n: d.side.store.allocate(n, wait=False),
                        chunk_bytes=lambda n: chunk_bytes(layout, n), nixl=d.side.nixl, block_size=BLOCK)
    pull = fetch_chunks(consumer, FetchSpec(p.endpoint, "t1", [(full[0], 2), (full[1], 2)], False,
                                            landing=kv.landing([tuple(D_BLOCKS[:2]), tuple(D_BLOCKS[2:4])])))
    lent = fetch_chunks(consumer, FetchSpec(p.endpoint, "t2", [(k, 2) for k in full2], False))
    next(pull)  # chunk 0 landed from P's blocks: the lease is given to this connection
    next(lent).release()  # chunk 0 READ from P's CPU tier: P lends both chunks' buffers until the release
    d.side.start_loads((remote_job("d-wait", later, list(range(50, 54)), "t3", p.endpoint, wait=True),))
    server, leases, holds = p.side.chunk_server, p.side.engine_kv.leases, p.side.holds
    wait_for(lambda: len(server._waiting) == 2 and server.lent_chunks == 2)
    nonces = {m.transfer_id: m.nonce for m, _ in sent if isinstance(m, Hello)}
    replayed = {t: signed(Release(VERSION, t, nonce=nonces[t])) for t in ("t1", "t2", "t3")}
    fetches = [f for m, f in sent if isinstance(m, (Fetch, Fetches))
               and (m.fetches[0] if isinstance(m, Fetches) else m).transfer_id == "t2"]
    state = (p.side.engine_kv.held_bytes, leases.stats.released, holds.pinned_bytes(), holds.stats.released,
             server.lent_chunks, len(server._waiting))
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for frames in [*replayed.values(), *fetches]:
            connection = Connection(p.endpoint)
            refused(connection.ask(frames), "connection that sent no hello")
            connection.close()
        connection = Connection(p.endpoint)  # a connection of its own, not beginning t1
        hello = introduce(d.side._hello)
        assert isinstance(decode_reply(connection.ask(signed(hello))[1]), HelloReply)
        refused(connection.ask(signed(Release(VERSION, "t1", nonce=hello.nonce))), "did not begin it")
        connection.close()
    assert state[0] > 0 and state[4] == 2 and fetches
    assert (p.side.engine_kv.held_bytes, leases.stats.released, holds.pinned_bytes(), holds.stats.released,
            server.lent_chunks, len(server._waiting)) == state
    pull.close()
    lent.close()  # D's own releases: the very bytes replayed above, from the connections that began them
    assert [f for m, f in sent if isinstance(m, Release) and m.transfer_id != "t3"] == [replayed["t1"], replayed["t2"]]
    wait_ended(p)
    wait_for(lambda: server.lent_chunks == 0 and leases.stats.released == 1 and holds.stats.released == 2)
    assert torch.equal(d.blocks(D_BLOCKS[:2]), p.blocks(P_BLOCKS[:2]))
    p.side.save((SaveJob("p-3", tuple(prompt_keys(later)[0]), tuple(range(40, 44)), publish="t3", final=True),))
    assert d.wait_loaded("d-wait") == set()  # its fetches waited on, untouched by the replay
    assert torch.equal(d.blocks(range(50, 54)), p.blocks(range(40, 44)))
    wait_for(lambda: len(server._waiting) == 0 and holds.stats.released == 3)


class Replayer:
    """A chunk server stand-in (a CURVE ROUTER with the secret) that answers every hello with the
    handshake reply ``frames`` (or, ``echo``, that reply answering the hello: its nonce, signed)."""

    def __init__(self, frames: list[bytes], echo: bool = False):
        self.socket, port = bind_router("tcp://127.0.0.1:0", KEY, 1 << 20, 100)
        self.endpoint, self.frames, self.echo = f"tcp://127.0.0.1:{port}", frames, echo
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            if not self.socket.poll(10):
                continue
            identity, _, body = self.socket.recv_multipart()
            message = decode_request(body)
            if isinstance(message, Hello):
                reply = decode_reply(self.frames[1])
                frames = signed(msgspec.structs.replace(reply, nonce=message.nonce)) if self.echo else self.frames
                with contextlib.suppress(zmq.ZMQError):  # D gave up and went
                    self.socket.send_multipart([identity, *frames])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.socket.close(0)


@pytest.mark.parametrize("echo", [False, True], ids=["replayed", "answering"])
def test_a_handshake_reply_to_another_hello_is_refused(engines, monkeypatch, echo):
    """P's real reply to an earlier hello (its MAC right, P's NIXL metadata in it), replayed to D's
    next hello, ends that transfer at the handshake: D never uses the metadata. The control, the
    same reply answering the new hello, passes the handshake (and the stand-in says nothing more)."""
    p, d = engines("p", 1, pd_secret=SECRET), engines("d", 2, pd_secret=SECRET)
    replies, read = [], connection.read_reply

    def spy(frames, *args, **kwargs):  # the handshake replies D takes, as they came
        reply = read(frames, *args, **kwargs)
        if isinstance(reply, HelloReply):
            replies.append([f.bytes for f in frames])
        return reply

    monkeypatch.setattr(connection, "read_reply", spy)
    publish(p, PROMPT, P_BLOCKS, "t1")
    lend(p, "t1")
    d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", p.endpoint),))
    assert d.wait_loaded("d-req") == set() and len(replies) == 1
    replayer = Replayer(replies[0], echo)
    connects = []
    connect = d.side.nixl.connect
    monkeypatch.setattr(d.side.nixl, "connect", lambda *a, **k: connects.append(a) or connect(*a, **k))
    try:
        full = prompt_keys(PROMPT)[0]
        with pytest.raises(PeerError) as error:
            consumer = Consumer(d.side._hello, 300, KEY, allocate=lambda n: d.side.store.allocate(n, wait=False),
                                chunk_bytes=lambda n: chunk_bytes(d.side.transfers.layout, n), nixl=d.side.nixl,
                                block_size=BLOCK)
            list(fetch_chunks(consumer, FetchSpec(replayer.endpoint, "t1", [(full[0], 2)], False)))
    finally:
        replayer.close()
    if echo:
        assert "sent nothing" in str(error.value) and len(connects) == 1  # past the handshake: P's agent reached
    else:
        assert "answered another hello" in str(error.value) and connects == []


def test_with_a_secret_a_peer_without_the_chunk_servers_key_cannot_talk(engines):
    p = engines("p", 1, pd_secret=SECRET)
    server = p.side.chunk_server

    def hello() -> list[bytes]:  # a hello P answers, MAC right, nonce fresh
        return signed(introduce(p.side._hello))

    assert ask(p.endpoint, hello(), timeout_ms=300) is None  # plain ZMQ: no CURVE at all
    assert ask(p.endpoint, hello(), timeout_ms=300, secret=b"another-secret") is None  # another server key
    wait_for(lambda: server.rejected >= 2)  # each failed handshake counted
    assert server.received_total == 0
    reply = ask(p.endpoint, hello(), timeout_ms=2000, secret=KEY)  # the control
    assert reply is not None and isinstance(decode_reply(reply[1]), HelloReply)


class Tap:
    """A TCP relay to ``port`` on loopback that keeps every byte it forwards (what a wire tap sees)."""

    def __init__(self, port: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.port, self.seen, self.lock = port, bytearray(), threading.Lock()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return
            try:
                far = socket.create_connection(("127.0.0.1", self.port))
            except OSError:  # P went
                near.close()
                continue
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=self.pump, args=(a, b), daemon=True).start()

    def pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                with self.lock:
                    self.seen += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no-secret"])
def test_a_wire_tap_sees_no_handshake_under_the_secret(engines, secret):
    """P's NIXL metadata (UCX's remote keys of its registered memory) travels in its handshake
    reply: under the secret a tap between D and P sees none of it; without (the control), all."""
    config = {"pd_secret": secret} if secret else {}
    p, d = engines("p", 1, **config), engines("d", 2, **config)
    tap = Tap(p.side.chunk_server.port)
    try:
        publish(p, PROMPT, P_BLOCKS, "t1")
        lend(p, "t1")
        d.side.start_loads((remote_job("d-req", PROMPT, D_BLOCKS, "t1", tap.endpoint),))
        assert d.wait_loaded("d-req") == set()
        assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
        with tap.lock:
            seen = bytes(tap.seen)
        assert (p.side.nixl.metadata() in seen) == (secret is None)
        assert (b"hello_reply" in seen) == (secret is None)
    finally:
        tap.close()


def test_the_side_channels_key_is_derived_from_the_secret():
    from kvtier.pd.channel import server_keys

    public, secret_key = server_keys(KEY)
    assert server_keys(KEY) == (public, secret_key) and len(public) == len(secret_key) == 40
    assert zmq.curve_public(secret_key) == public and server_keys(b"another")[0] != public


def test_the_nonces_and_connections_a_chunk_server_keeps_are_bounded(monkeypatch):
    """Nonces are kept twice the window (a hello sent within it can come no later), at most
    ``MAX_NONCES`` (hellos past that are refused, not taken unremembered); a connection quiet for
    ``idle_s`` is forgotten, as are the transfers it began."""
    from kvtier.pd.producer import handshakes
    from kvtier.pd.protocol import HELLO_WINDOW_S

    clock = [1000.0]
    monkeypatch.setattr(handshakes.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(handshakes, "MAX_NONCES", 3)
    seen = handshakes.Handshakes(idle_s=600.0)
    base = Hello(VERSION, 0, 1, b"f" * 16, "fuzz", 32)
    hellos = [introduce(base, transfer_id=f"t{i}") for i in range(4)]
    assert [seen.hello(bytes([i]), h) for i, h in enumerate(hellos[:3])] == ["", "", ""]
    assert "more than 3 hellos" in seen.hello(b"\3", hellos[3])
    assert "replayed" in seen.hello(b"\4", hellos[0])
    clock[0] += 2 * HELLO_WINDOW_S + 1  # the first three nonces age out; their connections stay bound
    assert seen.hello(b"\3", introduce(hellos[3])) == "" and seen.bound == 4
    assert seen.release(b"\0", Release(VERSION, "t0", nonce=hellos[0].nonce)) == ""  # began it: taken, unbound
    assert seen.bound == 3
    clock[0] += 601  # every connection quiet past idle_s
    seen.expire()
    assert seen.bound == 0 and "sent no hello" in seen.release(b"\1", Release(VERSION, "t1", nonce=hellos[1].nonce))
