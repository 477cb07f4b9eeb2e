"""Real ZMQ sockets: the commit protocol end to end, malformed messages, a dead server."""

import contextlib
import logging
import os
import socket
import time
import uuid

import msgspec
import pytest
import zmq
from hypothesis import given, settings, strategies as st

from kvtier.keys import storage_key
from kvtier.lookup import HoldReporter, LookupClient, LookupServer
from kvtier.lookup.protocol import MAX_MESSAGE_BYTES, VERSION, HoldReport, encode

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16
FINGERPRINTS = [b"0" * 16, b"1" * 16]


def endpoint(tmp_path):
    return f"ipc://{tmp_path}/{uuid.uuid4().hex[:8]}.sock"


class Rank:
    """A worker rank's holdings (chain key -> tier) and its real reporter."""

    def __init__(self, server: LookupServer, rank: int, world_size: int = 2):
        self.fingerprint = FINGERPRINTS[rank]
        self.tiers: dict[bytes, str] = {}  # by storage key
        self.reporter = HoldReporter(server.endpoint, rank, world_size, self.fingerprint, self.tiers.get)

    def hold(self, key: bytes, tier: str | None) -> None:
        skey = storage_key(key, self.fingerprint)
        if tier is None:
            self.tiers.pop(skey, None)
        else:
            self.tiers[skey] = tier
        self.reporter.changed([skey])

    def sync(self) -> None:
        assert self.reporter.flush()


def wait_for(client, keys, expected, tries=300):
    """Reports travel asynchronously: poll until the lookup shows ``expected``."""
    got = None
    for _ in range(tries):
        got = client.prefix_tiers(keys)
        if got == expected:
            return
        time.sleep(0.01)
    raise AssertionError(f"lookup {got} never became {expected}")


@contextlib.contextmanager
def one_rank(tmp_path):
    """A server of one rank, that rank's reporter and a client in this process; closed after."""
    server = LookupServer(endpoint(tmp_path), 1)
    rank = Rank(server, 0, world_size=1)
    client = LookupClient(server.endpoint, 2000)
    try:
        yield rank, client
    finally:
        client.close()
        rank.reporter.close()
        server.close()


@pytest.mark.parametrize("direct", [True, False], ids=["in-process", "socket"])
def test_a_chunk_is_visible_only_while_every_rank_holds_it(tmp_path, direct):
    server = LookupServer(endpoint(tmp_path), 2, lambda: {"cpu": 1.5})
    ranks = [Rank(server, 0), Rank(server, 1)]
    client = LookupClient(server.endpoint, 2000, direct=direct)
    try:
        ranks[0].hold(A, "cpu")
        ranks[0].hold(B, "cpu")
        ranks[1].hold(A, "cpu")
        wait_for(client, [A, B, C], ["cpu"])  # rank 1 never committed B
        ranks[1].hold(B, "disk")
        wait_for(client, [A, B, C], ["cpu", "disk"])  # the slowest rank's tier
        assert client.lookup([A]).chunk_load_ms == {"cpu": 1.5} and client.lookup([A]).probed == []
        ranks[1].hold(A, None)  # evicted on rank 1 only: withdrawn for everyone
        wait_for(client, [A, B], [])
        assert client.prefix_tiers([B]) == ["disk"]
    finally:
        client.close()
        for rank in ranks:
            rank.reporter.close()
        server.close()


def test_a_server_in_this_process_answers_without_a_socket_and_one_that_closed_is_a_miss(tmp_path):
    """TP=1: the scheduler and rank 0's server share a process; lookups skip the round trip."""
    server = LookupServer(endpoint(tmp_path), 1, lambda: {"cpu": 2.0})
    rank = Rank(server, 0, world_size=1)
    direct, wire = LookupClient(server.endpoint, 300), LookupClient(server.endpoint, 300, direct=False)
    try:
        rank.hold(A, "cpu")
        rank.hold(B, "disk")
        wait_for(direct, [A, B, C], ["cpu", "disk"])
        assert direct.lookup([A, B, C]) == wire.lookup([A, B, C])
        assert direct._socket is None and wire._socket is not None  # no socket opened in-process
        assert direct.lookup([B, A]) is not None and direct.lookup([B, A]).tiers == ["disk", "cpu"]
    finally:
        rank.reporter.close()
        server.close()
    try:
        assert direct.lookup([A]) is None  # the server is gone: over the socket, a miss after the timeout
        assert direct._socket is None  # timed out, reset
    finally:
        direct.close()
        wire.close()


def test_an_in_process_lookup_waits_for_a_busy_server_at_most_its_timeout(tmp_path, caplog):
    server = LookupServer(endpoint(tmp_path), 1)
    client = LookupClient(server.endpoint, 200)
    try:
        with server._lock:  # the server's thread in the middle of a message
            start = time.monotonic()
            assert client.lookup([A]) is None  # a miss, not a wait for the server
            assert 0.2 <= time.monotonic() - start < 0.2 + 0.5
        assert "was busy for 200 ms; treating as a miss" in caplog.text
        assert client.lookup([A]) is not None  # answered again once the server is free
    finally:
        client.close()
        server.close()


def test_a_report_flushed_in_the_servers_process_is_seen_by_the_next_lookup(tmp_path):
    """Rank 0's reporter hands its reports to the server in its process: applied once flushed."""
    with one_rank(tmp_path) as (rank, client):
        for i in range(20):
            key = bytes([i]) * 16
            rank.hold(key, "cpu")
            rank.sync()
            assert client.prefix_tiers([key]) == ["cpu"]  # no polling: applied when the flush returned
            rank.hold(key, None)
            rank.sync()
            assert client.prefix_tiers([key]) == []


def test_in_process_lookups_and_reports_interleave_safely(tmp_path):
    """The index changes on the server's thread while the engine's thread reads it: one lock."""
    keys = [bytes([i]) * 16 for i in range(64)]
    with one_rank(tmp_path) as (rank, client):
        for round_ in range(20):
            for key in keys:
                rank.hold(key, "cpu" if round_ % 2 == 0 else None)
            for _ in range(50):
                tiers = client.prefix_tiers(keys)
                assert tiers == ["cpu"] * len(tiers)  # a prefix, never a broken answer
        wait_for(client, keys, [])  # the last round withdrew every key


def test_the_tier_is_read_when_the_report_is_sent_so_a_late_report_cannot_undo_an_eviction(tmp_path):
    with one_rank(tmp_path) as (rank, client):
        skey = storage_key(A, rank.fingerprint)
        rank.tiers[skey] = "cpu"
        rank.reporter.changed([skey])  # "stored" ...
        del rank.tiers[skey]
        rank.reporter.changed([skey])  # ... then evicted before the reporter got to it
        rank.hold(B, "cpu")  # reports from one rank are applied in order: once B shows, so has A
        wait_for(client, [B], ["cpu"])
        assert client.prefix_tiers([A]) == []


def test_reports_from_another_world_size_are_refused_and_logged(tmp_path, caplog):
    server = LookupServer(endpoint(tmp_path), 2)
    stray = Rank(server, 0, world_size=1)
    client = LookupClient(server.endpoint, 2000)
    caplog.set_level(logging.WARNING)
    try:
        stray.hold(A, "cpu")
        stray.sync()
        deadline = time.monotonic() + 5
        while "world size 1" not in caplog.text:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert client.prefix_tiers([A]) == []
    finally:
        client.close()
        stray.reporter.close()
        server.close()


def test_other_protocol_versions_are_refused(tmp_path, caplog):
    server = LookupServer(endpoint(tmp_path), 1)
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        sock.send(msgspec.msgpack.encode({"type": "lookup", "version": VERSION + 1, "keys": [A]}))
        assert sock.poll(2000)
        assert b"protocol version" in sock.recv()
    finally:
        sock.close()
        server.close()


def test_dead_server_is_a_miss_not_a_hang(tmp_path, caplog):
    client = LookupClient(endpoint(tmp_path), 200)
    assert client.prefix_tiers([A]) == []
    assert client.lookup([A]) is None  # the stuck REQ socket was replaced
    assert "did not answer" in caplog.text
    client.close()


def test_after_a_timeout_lookups_back_off_instead_of_each_waiting(tmp_path):
    """A scheduler step admitting many requests used to wait one timeout per request while the
    server was silent (four requests: four timeouts); now one, then misses without asking until
    the back-off ends, and answers again once the server does."""
    address = endpoint(tmp_path)
    client = LookupClient(address, 200, direct=False)  # the socket's back-off
    try:
        start = time.monotonic()
        assert [client.lookup([A]) for _ in range(4)] == [None] * 4  # nobody serves the address yet
        assert time.monotonic() - start < 0.2 + 0.15
        server = LookupServer(address, 1)
        try:
            server.index.apply(HoldReport(VERSION, 0, 1, FINGERPRINTS[0], [storage_key(A, FINGERPRINTS[0])], ["cpu"]))
            assert client.lookup([A]) is None  # still backing off (1 s)
            time.sleep(1.1)
            assert client.prefix_tiers([A]) == ["cpu"]
        finally:
            server.close()
    finally:
        client.close()


_keys = st.lists(st.binary(min_size=0, max_size=20), max_size=4)
_messages = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda v, k: msgspec.msgpack.encode({"type": "lookup", "version": v, "keys": k}),
              st.integers(-5, 5), _keys),
    st.builds(lambda v, r, w, f, k, t: msgspec.msgpack.encode(
        {"type": "hold", "version": v, "rank": r, "world_size": w, "fingerprint": f, "keys": k, "tiers": t}),
        st.sampled_from([VERSION, VERSION + 1]), st.integers(-2, 3), st.integers(-1, 3), st.binary(max_size=17),
        _keys, st.lists(st.sampled_from(["cpu", "disk", "", "tape"]), max_size=4)),
    st.builds(lambda d: msgspec.msgpack.encode(d), st.dictionaries(st.text(max_size=8), st.integers(-2**63, 2**63 - 1), max_size=3)),
)


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory):
    """One server takes every fuzzed message in turn: it must survive them all."""
    server = LookupServer(endpoint(tmp_path_factory.mktemp("fuzz")), 1)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    client = LookupClient(server.endpoint, 2000)
    yield server, sock, client
    client.close()
    sock.close()
    server.close()


@settings(max_examples=150, deadline=None)
@given(_messages)
def test_fuzzed_messages_are_rejected_and_the_server_keeps_serving(fuzzed_server, message):
    server, sock, client = fuzzed_server
    sock.send_multipart([b"", message])
    # Whatever it was (refused, or a report the index accepted), the server still answers.
    assert client.lookup([A]) is not None


def test_a_malformed_message_is_answered_with_an_error_and_logged(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    server = LookupServer(endpoint(tmp_path), 1)
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        sock.send(msgspec.msgpack.encode({"type": "lookup", "version": VERSION, "keys": [b"short"]}))
        assert sock.poll(2000)
        assert b"malformed" in sock.recv()
        assert "rejected a malformed message" in caplog.text
    finally:
        sock.close()
        server.close()


def test_oversized_message_is_dropped_and_server_survives(tmp_path):
    server = LookupServer(endpoint(tmp_path), 1)
    server.index.apply(HoldReport(VERSION, 0, 1, FINGERPRINTS[0], [storage_key(A, FINGERPRINTS[0])], ["cpu"]))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    sock.send_multipart([b"", b"x" * (MAX_MESSAGE_BYTES + 1)])
    client = LookupClient(server.endpoint, 2000)
    try:
        assert client.prefix_tiers([A]) == ["cpu"]
    finally:
        client.close()
        sock.close()
        server.close()


def test_ipc_socket_is_private_to_its_user(tmp_path):
    server = LookupServer(endpoint(tmp_path), 1)
    try:
        mode = (tmp_path / server.endpoint.rsplit("/", 1)[1]).stat().st_mode & 0o777
        assert mode == 0o600
    finally:
        server.close()


def test_request_encoding_is_stable():
    # The wire format other processes (and other kvtier versions) parse: a tagged msgpack map.
    assert msgspec.msgpack.decode(encode(HoldReport(VERSION, 1, 2, A, [B], ["disk"]))) == {
        "type": "hold", "version": VERSION, "rank": 1, "world_size": 2, "fingerprint": A, "keys": [B], "tiers": ["disk"]}


def test_a_reply_says_which_figures_come_from_a_measured_read_speed(tmp_path):
    server = LookupServer(endpoint(tmp_path), 1, lambda: {"cpu": 1.5, "disk": 20.0}, probed=lambda: ["disk"])
    client = LookupClient(server.endpoint, 2000)
    try:
        reply = client.lookup([A], always=True)
        assert reply.chunk_load_ms == {"cpu": 1.5, "disk": 20.0} and reply.probed == ["disk"]
    finally:
        client.close()
        server.close()


def test_socket_files_of_lookup_servers_that_ended_are_swept_at_start(tmp_path):
    """A killed engine leaves its lookup socket file; the next server removes such files once old,
    never a live server's, nor a young file (a server may be between its bind and its listen)."""
    def left_behind(name: str, age_s: float) -> str:
        path = str(tmp_path / name)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(path)  # closed unlinked: nothing listens
        os.utime(path, (time.time() - age_s, time.time() - age_s))
        return path

    dead = left_behind("kvtier-lookup-dead.sock", 120)
    young = left_behind("kvtier-lookup-young.sock", 5)
    other = left_behind("other-dead.sock", 120)
    live = LookupServer(f"ipc://{tmp_path}/kvtier-lookup-live.sock", 1)
    try:
        old = time.time() - 120
        os.utime(live.endpoint[6:], (old, old))
        server = LookupServer(f"ipc://{tmp_path}/kvtier-lookup-new-{uuid.uuid4().hex[:6]}.sock", 1)
        server.close()
        assert not os.path.exists(dead)
        assert os.path.exists(young) and os.path.exists(other) and os.path.exists(live.endpoint[6:])
        client = LookupClient(live.endpoint, 2000)  # the live one still answers
        assert client.lookup([b"k" * 16]) is not None
        client.close()
    finally:
        live.close()
